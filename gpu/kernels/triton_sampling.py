"""One-pass sampling: temperature, counter-based noise and argmax in a Triton kernel.

The torch sampler builds its Exp(1) noise from int64 tensors as large as the
logits, some forty passes over [rows, vocab]: at 256 rows of a 152k vocabulary
that is more device time than the model's own weights. This kernel computes the
same noise in registers (the same hash, the same float64 arithmetic) while it
reads each logit once, and keeps a running argmax; the tokens are the torch
sampler's. It serves rows without top-k, top-p or min-p filters (those need a
sort and take the torch path); a row with temperature 0 is greedy.

Penalties (gpu/penalties.py) are applied here too, as each logit is read: the
row's output counts and prompt presence come from the PenaltyCounts pool, and
the float32 operations are apply_penalties' in its order. The kernel is compiled
without floating-point contraction, so ``logit - f * count`` is a product rounded
and then a difference, as in torch, never one fused multiply-add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trio_llm.gpu.sampler import MIX_MULTIPLIER_1, MIX_MULTIPLIER_2, ROW_KEY_SALT

VOCAB_PER_PROGRAM = 8192
BLOCK = 1024
MIX_1 = tl.constexpr(MIX_MULTIPLIER_1)
MIX_2 = tl.constexpr(MIX_MULTIPLIER_2)
SALT = tl.constexpr(ROW_KEY_SALT)


@triton.jit
def _mix32(values):
    """MurmurHash3's finaliser on int64 values in [0, 2**32); products wrap mod 2**64,
    so their low 32 bits are exact."""
    values = values ^ (values >> 16)
    values = (values * MIX_1) & 0xFFFFFFFF
    values = values ^ (values >> 13)
    values = (values * MIX_2) & 0xFFFFFFFF
    return values ^ (values >> 16)


@triton.jit
def _sample_kernel(logits_ptr, row_stride, temperatures_ptr, seed_keys_ptr, output_indices_ptr,
                   best_values_ptr, best_ids_ptr, vocab_size, num_splits,
                   penalty_slots_ptr, presences_ptr, frequencies_ptr, repetitions_ptr,
                   output_counts_ptr, prompt_seen_ptr, counts_stride,
                   VOCAB_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_PENALTIES: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    if HAS_PENALTIES:
        # a row without penalties has slot -1: nothing loaded, neutral values
        penalty_slot = tl.load(penalty_slots_ptr + row)
        is_penalized = penalty_slot >= 0
        counts_row = tl.maximum(penalty_slot, 0).to(tl.int64) * counts_stride
        presence = tl.load(presences_ptr + row)
        frequency = tl.load(frequencies_ptr + row)
        repetition = tl.load(repetitions_ptr + row)
        inverse_repetition = tl.math.div_rn(1.0, repetition)
    temperature = tl.load(temperatures_ptr + row)
    seed_key = tl.load(seed_keys_ptr + row).to(tl.int64)
    output_index = tl.load(output_indices_ptr + row).to(tl.int64) & 0xFFFFFFFF
    first_key = _mix32(seed_key ^ output_index)
    second_key = _mix32(first_key ^ SALT)
    row_logits = logits_ptr + row.to(tl.int64) * row_stride
    best_value = tl.full([BLOCK], float("-inf"), tl.float64)
    best_id = tl.zeros([BLOCK], tl.int64)
    start = split * VOCAB_PER_PROGRAM
    for offset in range(0, VOCAB_PER_PROGRAM, BLOCK):
        token_ids = start + offset + tl.arange(0, BLOCK)
        mask = token_ids < vocab_size
        logits = tl.load(row_logits + token_ids, mask=mask, other=float("-inf"))
        if HAS_PENALTIES:
            counts_mask = mask & is_penalized
            counts = tl.load(output_counts_ptr + counts_row + token_ids, mask=counts_mask,
                             other=0)
            in_prompt = tl.load(prompt_seen_ptr + counts_row + token_ids, mask=counts_mask,
                                other=0)
            in_output = counts > 0
            penalty = tl.where(in_output | (in_prompt != 0), repetition, 1.0)
            inverse = tl.where(in_output | (in_prompt != 0), inverse_repetition, 1.0)
            logits = logits * tl.where(logits > 0, inverse, penalty)
            logits = logits - frequency * counts.to(tl.float32)
            logits = logits - presence * in_output.to(tl.float32)
        if temperature > 0:
            scaled = tl.math.div_rn(logits, temperature).to(tl.float64)
            bits = _mix32(_mix32((token_ids.to(tl.int64) + first_key) & 0xFFFFFFFF)
                          ^ second_key)
            uniform = (bits.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
            values = scaled - tl.log(-tl.log(uniform))
        else:
            values = logits.to(tl.float64)
        values = tl.where(mask, values, float("-inf"))
        # per lane: strictly greater keeps the earliest token of equal values
        is_better = values > best_value
        best_id = tl.where(is_better, token_ids.to(tl.int64), best_id)
        best_value = tl.where(is_better, values, best_value)
    block_best = tl.max(best_value, 0)
    # the earliest token among the lanes holding the best value
    candidate = tl.where(best_value == block_best, best_id, vocab_size)
    tl.store(best_values_ptr + row * num_splits + split, block_best)
    tl.store(best_ids_ptr + row * num_splits + split, tl.min(candidate, 0))


@dataclass(frozen=True, slots=True)
class KernelPenalties:
    """Per-row penalty inputs of the kernel: ``slots`` [num_rows] int64 (-1: none),
    float32 ``presences``, ``frequencies``, ``repetitions`` [num_rows] (neutral where
    the slot is -1), and the PenaltyCounts pool's two tensors."""

    slots: torch.Tensor
    presences: torch.Tensor
    frequencies: torch.Tensor
    repetitions: torch.Tensor
    output_counts: torch.Tensor
    prompt_seen: torch.Tensor


def sample_without_filters(logits: torch.Tensor, temperatures: torch.Tensor,
                           seed_keys: torch.Tensor, output_indices: torch.Tensor,
                           penalties: KernelPenalties | None = None) -> torch.Tensor:
    """Token ids [num_rows] int64 for float32 ``logits`` [num_rows, vocab_size] (banned ids
    already -inf, logit bias added); ``seed_keys`` are sampler.seed_key(seed) per row."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and logits.dtype == torch.float32
    num_splits = triton.cdiv(vocab_size, VOCAB_PER_PROGRAM)
    best_values = torch.empty((num_rows, num_splits), dtype=torch.float64, device=logits.device)
    best_ids = torch.empty((num_rows, num_splits), dtype=torch.int64, device=logits.device)
    if num_rows:
        if penalties is None:
            # unused pointers: any tensor of the right dtypes
            penalty_args: tuple[object, ...] = (seed_keys, temperatures, temperatures,
                                                temperatures, seed_keys, seed_keys, 0)
        else:
            assert penalties.output_counts.stride(1) == 1
            penalty_args = (penalties.slots, penalties.presences, penalties.frequencies,
                            penalties.repetitions, penalties.output_counts,
                            penalties.prompt_seen, penalties.output_counts.stride(0))
        _sample_kernel[(num_rows, num_splits)](
            logits, logits.stride(0), temperatures, seed_keys, output_indices, best_values,
            best_ids, vocab_size, num_splits, *penalty_args,
            VOCAB_PER_PROGRAM=VOCAB_PER_PROGRAM, BLOCK=BLOCK,
            HAS_PENALTIES=penalties is not None, num_warps=4, enable_fp_fusion=False)
    # argmax picks the first split among equal values: the earliest token overall
    return best_ids.gather(1, best_values.argmax(dim=1, keepdim=True)).squeeze(1)
