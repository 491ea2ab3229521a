"""One-pass sampling: temperature, counter-based noise and argmax in a Triton kernel.

The torch sampler builds its Exp(1) noise from int64 tensors as large as the
logits, some forty passes over [rows, vocab]: at 256 rows of a 152k vocabulary
that is more device time than the model's own weights. This kernel computes the
same noise in registers (the same hash, the same float64 arithmetic) while it
reads each logit once, and keeps a running argmax; the tokens are the torch
sampler's. It serves rows without top-k, top-p or min-p filters (those need a
sort and take the torch path); a row with temperature 0 is greedy.
"""

from __future__ import annotations

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
                   VOCAB_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
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


def sample_without_filters(logits: torch.Tensor, temperatures: torch.Tensor,
                           seed_keys: torch.Tensor, output_indices: torch.Tensor) -> torch.Tensor:
    """Token ids [num_rows] int64 for float32 ``logits`` [num_rows, vocab_size] (banned ids
    already -inf); ``seed_keys`` are sampler.seed_key(seed) per row."""
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and logits.dtype == torch.float32
    num_splits = triton.cdiv(vocab_size, VOCAB_PER_PROGRAM)
    best_values = torch.empty((num_rows, num_splits), dtype=torch.float64, device=logits.device)
    best_ids = torch.empty((num_rows, num_splits), dtype=torch.int64, device=logits.device)
    if num_rows:
        _sample_kernel[(num_rows, num_splits)](
            logits, logits.stride(0), temperatures, seed_keys, output_indices, best_values,
            best_ids, vocab_size, num_splits, VOCAB_PER_PROGRAM=VOCAB_PER_PROGRAM, BLOCK=BLOCK,
            num_warps=4)
    # argmax picks the first split among equal values: the earliest token overall
    return best_ids.gather(1, best_values.argmax(dim=1, keepdim=True)).squeeze(1)
