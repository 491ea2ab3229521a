"""Sampling with every per-row option already on the device (the pipelined executor).

The same function as trio_llm.gpu.sampler.sample (same filters, in the same
order, the same counter-based noise, so the same tokens), but its inputs are
device tensors the executor uploaded asynchronously: nothing here copies from
the host or waits for the device, so the step can be enqueued while the
previous one still computes. Which filters run at all is decided on the host,
from the rows, exactly as the reference decides it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trio_llm.actors.messages import SamplingOptions
from trio_llm.gpu.penalties import (
    PenaltyCounts,
    add_logit_bias,
    apply_penalties,
    keep_allowed_tokens,
)
from trio_llm.gpu.sampler import (
    MASK_32,
    MIN_SAMPLING_TEMPERATURE,
    ROW_KEY_SALT,
    SamplingRow,
    _apply_min_p,
    _apply_top_k_top_p,
    allowed_entries,
    apply_token_bitmasks,
    banned_positions,
    bitmask_rows,
    logit_bias_entries,
    mix32,
    mix32_int,
    penalty_entries,
)


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """What the host decided for one step's rows: which filters run, and the
    per-row values to upload (temperature 0 rows get neutral values). ``top_ks`` and
    ``top_ps`` are empty unless ``any_top_k_top_p``, ``min_ps`` unless ``any_min_p``:
    nothing reads them then, and three segments fewer to pack a step.

    ``use_fused_kernel``: sample in one Triton pass (rows without filters only).
    ``bitmask_words``: the constrained rows' grammar bitmasks (int32 words, row after
    row) packed in int64s to travel in the int upload; ``num_bitmask_words`` int32
    words of it are real. ``penalty_rows``: the rows with penalties; the per-row
    ``penalty_slots`` (-1 elsewhere) and penalty values (neutral elsewhere) cover
    every row, as the fused kernel reads them.
    """

    any_sampled: bool
    any_top_k_top_p: bool
    any_min_p: bool
    temperatures: list[float]
    top_ps: list[float]
    min_ps: list[float]
    top_ks: list[int]
    seed_keys: list[int]
    output_indices: list[int]
    banned_rows: list[int]
    banned_token_ids: list[int]
    num_logprobs: list[int | None]
    use_fused_kernel: bool
    bitmask_rows: list[int]
    bitmask_words: np.ndarray
    num_bitmask_words: int
    allowed_rows: list[int] = field(default_factory=list)
    allowed_local_rows: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] = field(default_factory=list)
    logit_bias_rows: list[int] = field(default_factory=list)
    logit_bias_token_ids: list[int] = field(default_factory=list)
    logit_bias_values: list[float] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    penalty_slots: list[int] = field(default_factory=list)
    presences: list[float] = field(default_factory=list)
    frequencies: list[float] = field(default_factory=list)
    repetitions: list[float] = field(default_factory=list)

    @classmethod
    def from_rows(cls, rows: Sequence[SamplingRow], vocab_size: int, *,
                  can_fuse: bool) -> SamplingPlan:
        """``can_fuse``: the Triton sampling kernel is available (CUDA)."""
        # as the reference decides: below MIN_SAMPLING_TEMPERATURE a row is greedy, and
        # greedy rows upload temperature 0
        temperatures = [row.options.temperature
                        if row.options.temperature >= MIN_SAMPLING_TEMPERATURE else 0.0
                        for row in rows]
        sampled = [row for row, temperature in zip(rows, temperatures, strict=True)
                   if temperature > 0]
        banned_rows, banned_token_ids = banned_positions(rows, vocab_size)
        any_top_k_top_p = any(0 < row.options.top_k < vocab_size or row.options.top_p < 1.0
                              for row in sampled)
        any_min_p = any(row.options.min_p > 0.0 for row in sampled)
        masked_rows, packed = bitmask_rows(rows)
        num_bitmask_words = len(packed) // 4
        if num_bitmask_words % 2:
            packed += bytes(4)
        return cls(**_logit_change_fields(rows),
            any_sampled=bool(sampled),
            any_top_k_top_p=any_top_k_top_p,
            any_min_p=any_min_p,
            temperatures=temperatures,
            top_ps=[row.options.top_p if temperature > 0 else 1.0
                    for row, temperature in zip(rows, temperatures, strict=True)]
            if any_top_k_top_p else [],
            min_ps=[row.options.min_p if temperature > 0 else 0.0
                    for row, temperature in zip(rows, temperatures, strict=True)]
            if any_min_p else [],
            top_ks=[row.options.top_k if 0 < row.options.top_k < vocab_size and temperature > 0
                    else vocab_size
                    for row, temperature in zip(rows, temperatures, strict=True)]
            if any_top_k_top_p else [],
            seed_keys=[seed_key(row.options.seed) for row in rows],
            output_indices=[row.output_index for row in rows],
            banned_rows=banned_rows,
            banned_token_ids=banned_token_ids,
            num_logprobs=[row.options.num_logprobs for row in rows],
            use_fused_kernel=can_fuse and not any_top_k_top_p and not any_min_p,
            bitmask_rows=masked_rows,
            bitmask_words=np.frombuffer(packed, dtype=np.int64),
            num_bitmask_words=num_bitmask_words,
        )


    @classmethod
    def from_plain_rows(cls, row_values: Sequence[tuple[float, float, float, int, int]],
                        output_indices: list[int], vocab_size: int, *,
                        can_fuse: bool) -> SamplingPlan:
        """``from_rows`` of rows that are all plain (``is_plain``, no grammar bitmask),
        from their requests' ``plain_row_values``: the same plan, without a pass over
        rows per field (the usual step: nothing but temperature, top-k/p, min-p, seed)."""
        if not row_values:
            return cls.from_rows([], vocab_size, can_fuse=can_fuse)
        temperatures, top_ps, min_ps, top_ks, seed_keys = map(list, zip(*row_values,
                                                                        strict=True))
        # greedy rows upload neutral values, so these see the sampled rows only
        any_top_k_top_p = min(top_ks) < vocab_size or min(top_ps) < 1.0
        any_min_p = max(min_ps) > 0.0
        return cls(any_sampled=max(temperatures) > 0.0, any_top_k_top_p=any_top_k_top_p,
                   any_min_p=any_min_p, temperatures=temperatures,
                   top_ps=top_ps if any_top_k_top_p else [],
                   min_ps=min_ps if any_min_p else [],
                   top_ks=top_ks if any_top_k_top_p else [], seed_keys=seed_keys,
                   output_indices=output_indices, banned_rows=[], banned_token_ids=[],
                   num_logprobs=[None] * len(row_values),
                   use_fused_kernel=can_fuse and not any_top_k_top_p and not any_min_p,
                   bitmask_rows=[], bitmask_words=_NO_WORDS, num_bitmask_words=0)


def plain_row_values(options: SamplingOptions, vocab_size: int
                     ) -> tuple[float, float, float, int, int]:
    """What a row of a request with these options uploads, as ``from_rows`` computes it:
    (temperature, top-p, min-p, top-k, seed key), neutral values for a greedy row.
    Computed once per request, not per row and step."""
    temperature = (options.temperature if options.temperature >= MIN_SAMPLING_TEMPERATURE
                   else 0.0)
    if temperature <= 0:
        return 0.0, 1.0, 0.0, vocab_size, seed_key(options.seed)
    top_k = options.top_k if 0 < options.top_k < vocab_size else vocab_size
    return temperature, options.top_p, options.min_p, top_k, seed_key(options.seed)


def is_plain(options: SamplingOptions) -> bool:
    """Whether a request's rows need nothing of the plan but ``plain_row_values``: no
    penalties, logit bias, allowed ids, logprobs, or banned ids (``min_tokens``)."""
    return (not options.has_penalties and not options.logit_bias_token_ids
            and options.allowed_token_ids is None and options.num_logprobs is None
            and not (options.min_tokens > 0 and options.banned_token_ids))


_NO_WORDS = np.zeros(0, dtype=np.int64)


def _logit_change_fields(rows: Sequence[SamplingRow]) -> dict[str, Any]:
    """The plan's allowed-token, logit-bias and penalty fields; none (the defaults,
    nothing to upload) in the usual step where no row has any: one pass decides."""
    if not any(row.penalty_slot >= 0 or row.options.logit_bias_token_ids
               or row.options.allowed_token_ids is not None for row in rows):
        return {}
    allowed_rows, allowed_local_rows, allowed_token_ids = allowed_entries(rows)
    bias_rows, bias_token_ids, bias_values = logit_bias_entries(rows)
    penalties = penalty_entries(rows)
    # per row, as the kernel reads them; nothing to upload in a step without penalties
    num_rows = len(rows) if penalties.rows else 0
    slots, presences, frequencies, repetitions = ([-1] * num_rows, [0.0] * num_rows,
                                                  [0.0] * num_rows, [1.0] * num_rows)
    for position, index in enumerate(penalties.rows):
        slots[index] = penalties.slots[position]
        presences[index] = penalties.presences[position]
        frequencies[index] = penalties.frequencies[position]
        repetitions[index] = penalties.repetitions[position]
    return dict(allowed_rows=allowed_rows, allowed_local_rows=allowed_local_rows,
                allowed_token_ids=allowed_token_ids, logit_bias_rows=bias_rows,
                logit_bias_token_ids=bias_token_ids, logit_bias_values=bias_values,
                penalty_rows=penalties.rows, penalty_slots=slots, presences=presences,
                frequencies=frequencies, repetitions=repetitions)


@functools.lru_cache(maxsize=65536)
def seed_key(seed: int) -> int:
    """The part of sampler.row_keys that depends on the seed alone (cached per seed)."""
    seed %= 2**64
    return mix32_int((seed & MASK_32) ^ mix32_int(seed >> 32))


_NO_INTS = torch.empty(0, dtype=torch.int64)
_NO_FLOATS = torch.empty(0, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class DeviceSamplingInputs:
    """The plan's per-row values as device tensors (views into the step's upload)."""

    temperatures: torch.Tensor  # [num_rows] float32
    top_ps: torch.Tensor  # [num_rows] float32
    min_ps: torch.Tensor  # [num_rows] float32
    top_ks: torch.Tensor  # [num_rows] int64
    seed_keys: torch.Tensor  # [num_rows] int64
    output_indices: torch.Tensor  # [num_rows] int64
    banned_rows: torch.Tensor  # [num_banned] int64
    banned_token_ids: torch.Tensor  # [num_banned] int64
    # constrained rows only (plan.bitmask_rows); empty where no row is constrained
    bitmask_rows: torch.Tensor = field(default_factory=lambda: _NO_INTS)  # [num_constrained]
    bitmask_words: torch.Tensor = field(default_factory=lambda: _NO_INTS)  # int32 pairs
    allowed_rows: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    allowed_local_rows: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    allowed_token_ids: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    logit_bias_rows: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    logit_bias_token_ids: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    logit_bias_values: torch.Tensor = field(default_factory=lambda: _NO_FLOATS)
    penalty_rows: torch.Tensor = field(default_factory=lambda: _NO_INTS)
    penalty_slots: torch.Tensor = field(default_factory=lambda: _NO_INTS)  # [num_rows]
    presences: torch.Tensor = field(default_factory=lambda: _NO_FLOATS)  # [num_rows]
    frequencies: torch.Tensor = field(default_factory=lambda: _NO_FLOATS)  # [num_rows]
    repetitions: torch.Tensor = field(default_factory=lambda: _NO_FLOATS)  # [num_rows]


def sample_on_device(logits: torch.Tensor, plan: SamplingPlan, inputs: DeviceSamplingInputs,
                     penalty_counts: PenaltyCounts | None = None) -> torch.Tensor:
    """Token ids [num_rows] int64 for ``logits`` [num_rows, vocab_size] float32. The rows
    with penalties read ``penalty_counts``; the caller records the sampled tokens
    there afterwards (``record_on_device``). On CUDA the grammar's masks go into
    ``logits`` itself unless a row wants logprobs (those are of the raw distribution,
    which the caller then still has)."""
    masked = _masked(logits, plan, inputs)
    if plan.use_fused_kernel and (plan.any_sampled or plan.penalty_rows):
        from trio_llm.gpu.kernels.triton_sampling import KernelPenalties, sample_without_filters

        penalties = None
        if plan.penalty_rows:
            assert penalty_counts is not None
            penalties = KernelPenalties(
                slots=inputs.penalty_slots, presences=inputs.presences,
                frequencies=inputs.frequencies, repetitions=inputs.repetitions,
                output_counts=penalty_counts.output_counts,
                prompt_seen=penalty_counts.prompt_seen)
        return sample_without_filters(masked, inputs.temperatures, inputs.seed_keys,
                                      inputs.output_indices, penalties)
    if plan.penalty_rows:
        assert penalty_counts is not None
        rows = inputs.penalty_rows
        masked = apply_penalties(masked, rows, inputs.penalty_slots.index_select(0, rows),
                                 inputs.presences.index_select(0, rows),
                                 inputs.frequencies.index_select(0, rows),
                                 inputs.repetitions.index_select(0, rows), penalty_counts)
    greedy = masked.argmax(dim=-1)
    if not plan.any_sampled:
        return greedy
    is_sampled = inputs.temperatures > 0
    temperatures = torch.where(is_sampled, inputs.temperatures, 1.0).unsqueeze(1)
    scaled = masked / temperatures
    if plan.any_top_k_top_p:
        scaled = _apply_top_k_top_p(scaled, inputs.top_ks.unsqueeze(1), inputs.top_ps.unsqueeze(1))
    if plan.any_min_p:
        scaled = _apply_min_p(scaled, inputs.min_ps.unsqueeze(1))
    first_keys = mix32(inputs.seed_keys ^ (inputs.output_indices & MASK_32))
    second_keys = mix32(first_keys ^ ROW_KEY_SALT)
    noise_log = exponential_noise_log(first_keys, second_keys, logits.shape[1])
    sampled = (scaled.to(torch.float64) - noise_log).argmax(dim=-1)
    return torch.where(is_sampled, sampled, greedy)


def exponential_noise_log(first_keys: torch.Tensor, second_keys: torch.Tensor,
                          vocab_size: int) -> torch.Tensor:
    """``log`` of the reference's Exp(1) noise, from row keys already on the device."""
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=first_keys.device)
    bits = mix32(mix32((token_ids.unsqueeze(0) + first_keys.unsqueeze(1)) & MASK_32)
                 ^ second_keys.unsqueeze(1))
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32
    return (-uniform.log()).log()


def _masked(logits: torch.Tensor, plan: SamplingPlan,
            inputs: DeviceSamplingInputs) -> torch.Tensor:
    """The logits after the grammar, allowed-token, banned-id and logit-bias changes, in
    the reference's order: a copy where any applies, except the grammar's masks on CUDA
    (in place when no row wants logprobs)."""
    masked = logits
    if plan.bitmask_rows:
        words = inputs.bitmask_words.view(torch.int32)[:plan.num_bitmask_words]
        words = words.view(len(plan.bitmask_rows), -1)
        if logits.is_cuda:
            from trio_llm.gpu.kernels.triton_bitmask import apply_token_bitmasks_inplace

            if any(count is not None for count in plan.num_logprobs):
                masked = logits.clone()
            apply_token_bitmasks_inplace(masked, inputs.bitmask_rows, words)
        else:
            masked = apply_token_bitmasks(logits, inputs.bitmask_rows, words)
    if plan.allowed_rows:
        masked = keep_allowed_tokens(masked, inputs.allowed_rows, inputs.allowed_local_rows,
                                     inputs.allowed_token_ids)
    if plan.banned_rows:
        masked = masked.clone() if masked is logits else masked
        masked[inputs.banned_rows, inputs.banned_token_ids] = float("-inf")
    if plan.logit_bias_rows:
        masked = add_logit_bias(masked, inputs.logit_bias_rows, inputs.logit_bias_token_ids,
                                inputs.logit_bias_values)
    return masked


def record_on_device(penalty_counts: PenaltyCounts, plan: SamplingPlan,
                     inputs: DeviceSamplingInputs, sampled: torch.Tensor) -> None:
    """Count the sampled tokens of the rows with penalties (on the sampling stream)."""
    if plan.penalty_rows:
        rows = inputs.penalty_rows
        penalty_counts.record(inputs.penalty_slots.index_select(0, rows),
                              sampled.index_select(0, rows))
