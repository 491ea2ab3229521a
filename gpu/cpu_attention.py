"""Paged attention on the CPU: one compiled kernel for every row of a step, batch-invariant.

The kernel (numba, compiled on first use and cached on disk) walks the step's
rows, decode tokens and prefill chunks alike, straight over the paged cache
through the block tables: no Python loop over sequences, no gathered copy of
the keys and values, no padding. It implements gpu/attention.py's contract.

Batch invariance holds by construction, not by luck: a query row at position
``p`` is computed alone, by the same loops, from its own query and the keys
and values at positions ``0..p``: an exact two-pass softmax (scores and their
maximum, then the exponentials and their sum, then the weighted values).
Every reduction's length and order depend on ``p`` and the head size only, so
the row's result is the same bits whatever else the step holds, however its
prompt was chunked, and whatever the block size or the block ids. Work is never
split across threads inside a row.

Only float32 queries and caches take this path; other dtypes go to the
float64 reference (gpu/attention.py).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from trio_llm.gpu.attention import float64_paged_attention, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]

# Reassociation lets LLVM vectorize a reduction; its lane split then depends on the
# reduction's length alone, which is a function of the row's own position. No flag
# here assumes away infinities or NaNs: -inf is a real value in a softmax.
FASTMATH = {"contract", "reassoc", "nsz", "arcp"}


@numba.njit(fastmath=FASTMATH, boundscheck=False, error_model="numpy", cache=True, nogil=True)
def _attend_rows(query: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
                 block_tables: np.ndarray, context_lens: np.ndarray,
                 query_start_loc: np.ndarray, block_size: int, num_heads: int,
                 num_kv_heads: int, scale: float, out: np.ndarray) -> None:  # pragma: no cover
    """``query``/``out`` [num_tokens * num_heads, head_dim]; ``k_rows``/``v_rows``
    [num_slots * num_kv_heads, head_dim]: the caches seen as one row per (slot, KV head)."""
    head_dim = query.shape[1]
    group_size = num_heads // num_kv_heads
    max_context_len = 0
    for seq_index in range(context_lens.shape[0]):
        max_context_len = max(max_context_len, context_lens[seq_index])
    scores = np.empty((group_size, max_context_len), dtype=np.float32)
    slot_rows = np.empty(max_context_len, dtype=np.int64)
    accumulator = np.empty((group_size, head_dim), dtype=np.float32)
    for seq_index in range(context_lens.shape[0]):
        start, end = query_start_loc[seq_index], query_start_loc[seq_index + 1]
        context_len = context_lens[seq_index]
        if end == start or context_len == 0:
            continue
        for position in range(context_len):
            block_id = block_tables[seq_index, position // block_size]
            slot_rows[position] = (block_id * block_size + position % block_size) * num_kv_heads
        for token in range(start, end):
            num_keys = context_len - (end - token) + 1
            for kv_head in range(num_kv_heads):
                first_row = token * num_heads + kv_head * group_size
                _attend_one(query, k_rows, v_rows, slot_rows, num_keys, kv_head, first_row,
                            group_size, scale, scores, accumulator, out)


@numba.njit(fastmath=FASTMATH, boundscheck=False, error_model="numpy", cache=True, nogil=True,
            inline="always")
def _attend_one(query: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
                slot_rows: np.ndarray, num_keys: int, kv_head: int, first_row: int,
                group_size: int, scale: float, scores: np.ndarray, accumulator: np.ndarray,
                out: np.ndarray) -> None:  # pragma: no cover
    """The query heads ``first_row ..+ group_size`` of one token over keys ``0..num_keys-1``."""
    head_dim = query.shape[1]
    for group_index in range(group_size):
        row = first_row + group_index
        maximum = np.float32(-np.inf)
        for key in range(num_keys):
            key_row = slot_rows[key] + kv_head
            dot = np.float32(0.0)
            for dim in range(head_dim):
                dot += query[row, dim] * k_rows[key_row, dim]
            dot *= scale
            scores[group_index, key] = dot
            maximum = max(maximum, dot)
        total = np.float32(0.0)
        for key in range(num_keys):
            weight = math.exp(scores[group_index, key] - maximum)
            scores[group_index, key] = weight
            total += weight
        for dim in range(head_dim):
            accumulator[group_index, dim] = 0.0
        for key in range(num_keys):
            value_row = slot_rows[key] + kv_head
            weight = scores[group_index, key]
            for dim in range(head_dim):
                accumulator[group_index, dim] += weight * v_rows[value_row, dim]
        inverse_total = np.float32(1.0) / total
        for dim in range(head_dim):
            out[row, dim] = accumulator[group_index, dim] * inverse_total


def can_use_kernel(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel takes float32 tensors in the CPU's memory."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.dtype == torch.float32)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """gpu/attention.py's paged_attention, batch-invariant; float64 reference for other dtypes."""
    if not can_use_kernel(query, k_cache):
        return float64_paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                       query_start_loc, scale)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # Rows of no sequence (none today) read as zeros, as in the reference.
    output = torch.zeros_like(query)
    _attend_rows(query.contiguous().view(-1, head_dim).numpy(),
                 k_cache.view(-1, head_dim).numpy(), v_cache.view(-1, head_dim).numpy(),
                 _as_array(block_tables), _as_array(context_lens), _as_array(query_start_loc),
                 block_size, num_heads, num_kv_heads, np.float32(scale),
                 output.view(-1, head_dim).numpy())
    return output


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    """An int32 or int64 tensor as a contiguous numpy array (no copy when it already is one)."""
    return tensor.contiguous().numpy()
