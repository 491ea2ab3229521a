"""Choosing the next token of each row: greedy, or sampled with per-request randomness.

A sampled row draws by the exponential race (the Gumbel-max trick): the token
maximising ``logit / temperature - log(E)``, where ``E`` is exponential noise
built from a counter-based hash of (seed, output position, token id). The noise
is integer arithmetic in int64 torch ops, so the CPU and CUDA draw the same
noise, and a row's draw never depends on the other rows of the batch nor on
anything drawn before: the same seed gives the same tokens in any batch.

Filters, in this order: the grammar's token bitmask (structured outputs), the
allowed token ids, banned ids (while the output is shorter than ``min_tokens``),
the logit bias, the penalties (gpu/penalties.py), temperature, top-k, top-p,
min-p; greedy rows take everything up to the penalties. Logprobs are those of
the raw model distribution (before any of these).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from trio_llm.actors.messages import PromptLogprobs, SamplingOptions, TokenLogprobs
from trio_llm.gpu.penalties import (
    PenaltyCounts,
    add_logit_bias,
    apply_penalties,
    keep_allowed_tokens,
)

MASK_32 = 0xFFFFFFFF
MASK_16 = 0xFFFF
# The two multipliers of MurmurHash3's 32-bit finaliser.
MIX_MULTIPLIER_1 = 0x85EBCA6B
MIX_MULTIPLIER_2 = 0xC2B2AE35
# Below this temperature a row is greedy: dividing by it would overflow float32.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Distinguishes the two row keys fed to the per-token mix.
ROW_KEY_SALT = 0x9E3779B9


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """One row of logits to sample: its request's options and its output position;
    ``token_bitmask`` the grammar's allowed tokens (ScheduledRequest.token_bitmask);
    ``penalty_slot`` its row in the executor's PenaltyCounts (-1: no penalties)."""

    options: SamplingOptions
    output_index: int
    token_bitmask: bytes | None = None
    penalty_slot: int = -1


@dataclass(slots=True)
class SamplerOutput:
    """``token_ids`` [num_rows] int64 on the logits' device; logprobs only where asked."""

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None] | None


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           penalty_counts: PenaltyCounts | None = None) -> SamplerOutput:
    """Pick one token for each row of ``logits`` [num_rows, vocab_size] (float32).
    Rows with a ``penalty_slot`` read their counts from ``penalty_counts`` (the caller
    records the sampled tokens there afterwards: ``record_sampled``)."""
    masked = _mask_banned_ids(_keep_allowed(mask_disallowed_tokens(logits, rows), rows), rows)
    masked = _penalized(_biased(masked, rows), rows, penalty_counts)
    token_ids = masked.argmax(dim=-1)
    sampled = [index for index, row in enumerate(rows)
               if row.options.temperature >= MIN_SAMPLING_TEMPERATURE]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        token_ids[index] = _sample_rows(masked[index], [rows[i] for i in sampled])
    num_logprobs = [row.options.num_logprobs for row in rows]
    return SamplerOutput(token_ids=token_ids,
                         logprobs=raw_logprobs(logits, token_ids, num_logprobs))


def bitmask_rows(rows: Sequence[SamplingRow]) -> tuple[list[int], bytes]:
    """(row indices, their bitmasks concatenated) of the constrained rows."""
    indices = [index for index, row in enumerate(rows) if row.token_bitmask is not None]
    return indices, b"".join(rows[index].token_bitmask or b"" for index in indices)


def apply_token_bitmasks(logits: torch.Tensor, row_indices: torch.Tensor,
                         words: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token a row's bitmask forbids at -inf (a copy).

    ``words`` [len(row_indices), num_words] int32 on the logits' device: bit j of
    word w allows token 32 * w + j. Runs on any device, as plain torch ops.
    """
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab_size].bool()
    masked = logits.clone()
    masked[row_indices] = logits[row_indices].masked_fill(~allowed, float("-inf"))
    return masked


def mask_disallowed_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    indices, packed = bitmask_rows(rows)
    if not indices:
        return logits
    words = torch.frombuffer(bytearray(packed), dtype=torch.int32).view(len(indices), -1)
    return apply_token_bitmasks(logits, torch.tensor(indices, device=logits.device),
                                words.to(logits.device))


def banned_positions(rows: Sequence[SamplingRow], vocab_size: int
                     ) -> tuple[list[int], list[int]]:
    """(row indices, token ids) to mask: each row's in-vocabulary banned ids, while its
    output is shorter than its ``min_tokens``."""
    row_indices: list[int] = []
    token_ids: list[int] = []
    for index, row in enumerate(rows):
        if row.output_index < row.options.min_tokens:
            banned = [token_id for token_id in row.options.banned_token_ids
                      if 0 <= token_id < vocab_size]
            row_indices += [index] * len(banned)
            token_ids += banned
    return row_indices, token_ids


@dataclass(frozen=True, slots=True)
class PenaltyEntries:
    """The rows with penalties: their indices, pool slots and values (per such row)."""

    rows: list[int]
    slots: list[int]
    presences: list[float]
    frequencies: list[float]
    repetitions: list[float]


def penalty_entries(rows: Sequence[SamplingRow]) -> PenaltyEntries:
    indices = [index for index, row in enumerate(rows) if row.penalty_slot >= 0]
    options = [rows[index].options for index in indices]
    return PenaltyEntries(rows=indices, slots=[rows[index].penalty_slot for index in indices],
                          presences=[option.presence_penalty for option in options],
                          frequencies=[option.frequency_penalty for option in options],
                          repetitions=[option.repetition_penalty for option in options])


def logit_bias_entries(rows: Sequence[SamplingRow]) -> tuple[list[int], list[int], list[float]]:
    """(row indices, token ids, biases) of every row's logit bias."""
    row_indices: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    # one comprehension first: the plan of every step calls this, and few rows have any
    for index in [index for index, row in enumerate(rows) if row.options.logit_bias_token_ids]:
        options = rows[index].options
        row_indices += [index] * len(options.logit_bias_token_ids)
        token_ids += options.logit_bias_token_ids
        values += options.logit_bias_values
    return row_indices, token_ids, values


def allowed_entries(rows: Sequence[SamplingRow]) -> tuple[list[int], list[int], list[int]]:
    """(rows with allowed_token_ids, (index among them, token id) pairs)."""
    allowed_rows = [index for index, row in enumerate(rows)
                    if row.options.allowed_token_ids is not None]
    local_rows: list[int] = []
    token_ids: list[int] = []
    for local_row, index in enumerate(allowed_rows):
        allowed = rows[index].options.allowed_token_ids or []
        local_rows += [local_row] * len(allowed)
        token_ids += allowed
    return allowed_rows, local_rows, token_ids


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _floats(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _keep_allowed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    allowed_rows, local_rows, token_ids = allowed_entries(rows)
    if not allowed_rows:
        return logits
    device = logits.device
    return keep_allowed_tokens(logits, _long(allowed_rows, device), _long(local_rows, device),
                               _long(token_ids, device))


def _biased(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    row_indices, token_ids, values = logit_bias_entries(rows)
    if not row_indices:
        return logits
    device = logits.device
    return add_logit_bias(logits, _long(row_indices, device), _long(token_ids, device),
                          _floats(values, device))


def _penalized(logits: torch.Tensor, rows: Sequence[SamplingRow],
               penalty_counts: PenaltyCounts | None) -> torch.Tensor:
    entries = penalty_entries(rows)
    if not entries.rows:
        return logits
    assert penalty_counts is not None, "rows with a penalty slot need the counts"
    device = logits.device
    return apply_penalties(logits, _long(entries.rows, device), _long(entries.slots, device),
                           _floats(entries.presences, device),
                           _floats(entries.frequencies, device),
                           _floats(entries.repetitions, device), penalty_counts)


def record_sampled(penalty_counts: PenaltyCounts, rows: Sequence[SamplingRow],
                   token_ids: torch.Tensor) -> None:
    """Count each penalized row's sampled token in its pool row."""
    entries = penalty_entries(rows)
    if entries.rows:
        device = token_ids.device
        penalty_counts.record(_long(entries.slots, device),
                              token_ids.index_select(0, _long(entries.rows, device)))


def _mask_banned_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    row_indices, token_ids = banned_positions(rows, logits.shape[1])
    if not row_indices:
        return logits
    masked = logits.clone()
    masked[torch.tensor(row_indices, device=logits.device),
           torch.tensor(token_ids, device=logits.device)] = float("-inf")
    return masked


def _sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    def column(values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=logits.device).unsqueeze(1)

    vocab_size = logits.shape[1]
    scaled = logits / column([row.options.temperature for row in rows])
    top_ks = [row.options.top_k if 0 < row.options.top_k < vocab_size else vocab_size
              for row in rows]
    top_ps = [row.options.top_p for row in rows]
    if any(top_k < vocab_size for top_k in top_ks) or any(top_p < 1.0 for top_p in top_ps):
        scaled = _apply_top_k_top_p(scaled, column(top_ks).to(torch.long), column(top_ps))
    min_ps = [row.options.min_p for row in rows]
    if any(min_p > 0.0 for min_p in min_ps):
        scaled = _apply_min_p(scaled, column(min_ps))
    noise = exponential_noise(rows, vocab_size, device=logits.device)
    return (scaled.to(torch.float64) - noise.log()).argmax(dim=-1)


def _apply_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's ``top_k`` best tokens (ties with the k-th kept), then the smallest
    prefix of those, best first, whose probability reaches ``top_p``."""
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    kth_best = sorted_logits.gather(1, top_k - 1)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_best, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    probability_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(probability_before >= top_p, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, sorted_ids, sorted_logits)


def _apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` times the row's most likely token."""
    probs = scaled.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p
    return scaled.masked_fill(probs < threshold, float("-inf"))


# -- counter-based noise -------------------------------------------------------------


def exponential_noise(rows: Sequence[SamplingRow], vocab_size: int, *,
                      device: torch.device) -> torch.Tensor:
    """Exp(1) noise [num_rows, vocab_size] (float64), a pure function of
    (seed, output_index, token id) per element."""
    first_keys, second_keys = zip(*(row_keys(row.options.seed, row.output_index) for row in rows),
                                  strict=True)
    first = torch.tensor(first_keys, dtype=torch.int64, device=device).unsqueeze(1)
    second = torch.tensor(second_keys, dtype=torch.int64, device=device).unsqueeze(1)
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=device).unsqueeze(0)
    bits = mix32(mix32((token_ids + first) & MASK_32) ^ second)
    uniform = (bits.to(torch.float64) + 0.5) / 2.0**32  # in (0, 1), never 0 or 1
    return -uniform.log()


def row_keys(seed: int, output_index: int) -> tuple[int, int]:
    """Two 32-bit keys for one (seed, output position), computed on the host."""
    seed %= 2**64
    key = mix32_int((seed & MASK_32) ^ mix32_int(seed >> 32))
    key = mix32_int(key ^ (output_index & MASK_32))
    return key, mix32_int(key ^ ROW_KEY_SALT)


def mix32_int(value: int) -> int:
    """MurmurHash3's finaliser on a Python int (the host twin of ``mix32``)."""
    value &= MASK_32
    value ^= value >> 16
    value = (value * MIX_MULTIPLIER_1) & MASK_32
    value ^= value >> 13
    value = (value * MIX_MULTIPLIER_2) & MASK_32
    return value ^ (value >> 16)


def mix32(values: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int64 tensors holding values in [0, 2**32)."""
    values = values ^ (values >> 16)
    values = _multiply_mod_2_32(values, MIX_MULTIPLIER_1)
    values = values ^ (values >> 13)
    values = _multiply_mod_2_32(values, MIX_MULTIPLIER_2)
    return values ^ (values >> 16)


def _multiply_mod_2_32(values: torch.Tensor, multiplier: int) -> torch.Tensor:
    """``values * multiplier mod 2**32`` without overflowing int64: the multiplier is
    split in 16-bit halves so every intermediate product stays below 2**48."""
    low = values * (multiplier & MASK_16)
    high = ((values * (multiplier >> 16)) & MASK_16) << 16
    return (low + high) & MASK_32


# -- logprobs --------------------------------------------------------------------------

# Prompt logprobs are computed this many positions at a time: a whole chunk's logits
# ([tokens, vocab] float32) would be gigabytes for a long prompt.
PROMPT_LOGPROB_ROWS_PER_SLICE = 256


@dataclass(slots=True)
class PromptLogprobRows:
    """A step's positions whose prompt logprobs are asked: their rows in the step's
    flat token order, the prompt token each gives the logprob of, and per request
    (id, number of its positions, number of alternatives), in row order."""

    rows: list[int]
    target_token_ids: list[int]
    requests: list[tuple[str, int, int]]

    def add(self, request_id: str, first_row: int, target_token_ids: list[int],
            num_top: int) -> None:
        self.rows += range(first_row, first_row + len(target_token_ids))
        self.target_token_ids += target_token_ids
        self.requests.append((request_id, len(target_token_ids), num_top))


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    hidden: torch.Tensor, asked: PromptLogprobRows) -> list[PromptLogprobs]:
    """The prompt logprobs of ``asked``; ``hidden`` holds its rows' hidden states, in
    order. The logprobs are of the raw distribution, as for sampled tokens."""
    targets = torch.tensor(asked.target_token_ids, dtype=torch.int64, device=hidden.device)
    max_top = max(num_top for _, _, num_top in asked.requests)
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    for start in range(0, len(asked.rows), PROMPT_LOGPROB_ROWS_PER_SLICE):
        end = start + PROMPT_LOGPROB_ROWS_PER_SLICE
        logprobs = compute_logits(hidden[start:end]).float().log_softmax(dim=-1)
        chosen += logprobs.gather(1, targets[start:end].unsqueeze(1)).squeeze(1).tolist()
        if max_top:
            top = logprobs.topk(max_top, dim=-1)
            top_values += top.values.tolist()
            top_ids += top.indices.tolist()
        else:
            top_values += [[]] * logprobs.shape[0]
            top_ids += [[]] * logprobs.shape[0]
    results, position = [], 0
    for request_id, num_positions, num_top in asked.requests:
        results.append(PromptLogprobs(request_id=request_id, logprobs=[
            TokenLogprobs(logprob=chosen[index], top_token_ids=top_ids[index][:num_top],
                          top_logprobs=top_values[index][:num_top])
            for index in range(position, position + num_positions)]))
        position += num_positions
    return results


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                 num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None] | None:
    """Logprobs of the raw distribution for the rows whose ``num_logprobs`` is not None:
    the chosen token's, and the row's ``num_logprobs`` best; None if no row asked."""
    wanted = [index for index, count in enumerate(num_logprobs) if count is not None]
    if not wanted:
        return None
    index = torch.tensor(wanted, device=logits.device)
    logprobs = logits[index].log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1).tolist()
    max_top = max(num_logprobs[i] or 0 for i in wanted)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if max_top:
        top = logprobs.topk(max_top, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for position, row_index in enumerate(wanted):
        count = num_logprobs[row_index] or 0
        result[row_index] = TokenLogprobs(logprob=chosen[position],
                                          top_token_ids=top_ids[position][:count],
                                          top_logprobs=top_values[position][:count])
    return result
