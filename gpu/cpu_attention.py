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
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from trio_llm.gpu.attention import float64_paged_attention, write_kv_cache

__all__ = ["paged_attention", "warm_up", "write_kv_cache"]

# Reassociation lets LLVM vectorize a reduction; its lane split then depends on the
# reduction's length alone, which is a function of the row's own position. No flag
# here assumes away infinities or NaNs: -inf is a real value in a softmax.
FASTMATH = {"contract", "reassoc", "nsz", "arcp"}
# Positions ahead whose keys and values are prefetched: decode reads each slot once,
# from blocks scattered over the cache, and without prefetching it waited on memory
# (in a prototype, decode over scattered blocks ran about 3x slower than over blocks
# that fit in L2; prefetching took back most of the difference).
PREFETCH_DISTANCE = 8
FLOATS_PER_CACHE_LINE = 16
_kernel = numba.njit(fastmath=FASTMATH, boundscheck=False, error_model="numpy", cache=True,
                     nogil=True)
_inlined_kernel = numba.njit(fastmath=FASTMATH, boundscheck=False, error_model="numpy",
                             cache=True, nogil=True, inline="always")


def _prefetch_typing(typingctx: Any, array: Any, index: Any) -> Any:  # pragma: no cover
    """Ask the CPU to bring the cache line holding ``array[index]`` (1D) closer."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        array_type, _ = signature.args
        array_struct = context.make_array(array_type)(context, builder, args[0])
        pointer = cgutils.get_item_pointer(context, builder, array_type, array_struct, [args[1]])
        byte_pointer = builder.bitcast(pointer, ir.IntType(8).as_pointer())
        int32 = ir.IntType(32)
        function_type = ir.FunctionType(ir.VoidType(), [byte_pointer.type, int32, int32, int32])
        function = cgutils.get_or_insert_function(builder.module, function_type,
                                                  "llvm.prefetch.p0")
        # read, keep in all cache levels, data cache
        builder.call(function, [byte_pointer, int32(0), int32(3), int32(1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


# Called in the kernels as ``_prefetch(array, index)``.
_prefetch: Any = intrinsic(_prefetch_typing)


@_kernel
def _attend_rows(query: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
                 block_tables: np.ndarray, context_lens: np.ndarray,
                 query_start_loc: np.ndarray, block_size: int, num_heads: int,
                 num_kv_heads: int, scale: np.float32,
                 out: np.ndarray) -> None:  # pragma: no cover
    """``query``/``out`` [num_tokens * num_heads, head_dim]; ``k_rows``/``v_rows``
    [num_slots * num_kv_heads, head_dim]: the caches seen as one row per (slot, KV head)."""
    max_context_len = 0
    for seq_index in range(context_lens.shape[0]):
        max_context_len = max(max_context_len, context_lens[seq_index])
    scores = np.empty((num_heads, max_context_len), dtype=np.float32)
    slot_rows = np.empty(max_context_len, dtype=np.int64)
    accumulator = np.empty((num_heads, query.shape[1]), dtype=np.float32)
    maxima = np.empty(num_heads, dtype=np.float32)
    totals = np.empty(num_heads, dtype=np.float32)
    for seq_index in range(context_lens.shape[0]):
        start, end = query_start_loc[seq_index], query_start_loc[seq_index + 1]
        context_len = context_lens[seq_index]
        if end == start or context_len == 0:
            continue
        for position in range(context_len):
            block_id = block_tables[seq_index, position // block_size]
            slot_rows[position] = (block_id * block_size + position % block_size) * num_kv_heads
        for token in range(start, end):
            # The token's position is num_keys - 1: it sees every key up to its own.
            num_keys = context_len - (end - token) + 1
            _attend_token(query, k_rows, v_rows, slot_rows, num_keys, token * num_heads,
                          num_kv_heads, scale, scores, maxima, totals, accumulator,
                          out)


@_inlined_kernel
def _attend_token(query: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
                  slot_rows: np.ndarray, num_keys: int, first_row: int, num_kv_heads: int,
                  scale: np.float32, scores: np.ndarray, maxima: np.ndarray,
                  totals: np.ndarray, accumulator: np.ndarray,
                  out: np.ndarray) -> None:  # pragma: no cover
    """Every head of one token (rows ``first_row..``) over keys ``0..num_keys-1``.

    Exact two-pass softmax: the scores and each head's maximum, then the exponentials
    and their sum, then the weighted values. Keys are walked in position order, all
    heads at once, so each slot's keys and values are read once, front to back.
    """
    head_dim = query.shape[1]
    num_heads = scores.shape[0]
    group_size = num_heads // num_kv_heads
    k_flat, v_flat = k_rows.reshape(-1), v_rows.reshape(-1)
    maxima[:] = -np.inf
    for key in range(num_keys):
        if key + PREFETCH_DISTANCE < num_keys:
            _prefetch_slot(k_flat, v_flat, slot_rows[key + PREFETCH_DISTANCE] * head_dim,
                           num_kv_heads * head_dim)
        for kv_head in range(num_kv_heads):
            key_row = slot_rows[key] + kv_head
            for group_index in range(group_size):
                head = kv_head * group_size + group_index
                dot = np.float32(0.0)
                for dim in range(head_dim):
                    dot += query[first_row + head, dim] * k_rows[key_row, dim]
                dot *= scale
                scores[head, key] = dot
                maxima[head] = max(maxima[head], dot)
    for head in range(num_heads):
        maximum, total = maxima[head], np.float32(0.0)
        for key in range(num_keys):
            weight = math.exp(scores[head, key] - maximum)
            scores[head, key] = weight
            total += weight
        totals[head] = total
    accumulator[:] = 0.0
    for key in range(num_keys):
        for kv_head in range(num_kv_heads):
            value_row = slot_rows[key] + kv_head
            for group_index in range(group_size):
                head = kv_head * group_size + group_index
                weight = scores[head, key]
                for dim in range(head_dim):
                    accumulator[head, dim] += weight * v_rows[value_row, dim]
    for head in range(num_heads):
        inverse_total = np.float32(1.0) / totals[head]
        for dim in range(head_dim):
            out[first_row + head, dim] = accumulator[head, dim] * inverse_total


@_inlined_kernel
def _prefetch_slot(k_flat: np.ndarray, v_flat: np.ndarray, first: int,
                   num_floats: int) -> None:  # pragma: no cover
    """Prefetch one slot's keys and values: ``num_floats`` from offset ``first``."""
    for offset in range(first, first + num_floats, FLOATS_PER_CACHE_LINE):
        _prefetch(k_flat, offset)
        _prefetch(v_flat, offset)


def can_use_kernel(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel takes float32 tensors in the CPU's memory."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.dtype == torch.float32)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float) -> torch.Tensor:
    """gpu/attention.py's paged_attention, batch-invariant; float64 reference for other dtypes.

    The sequences are split into as many runs of about equal work as torch has intra-op
    threads, each run on its own thread (the kernel releases the GIL). A row is computed
    by one thread, the same way whichever, so the split changes no bits.
    """
    if not can_use_kernel(query, k_cache):
        return float64_paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                       query_start_loc, scale)
    _compile_once()
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # Rows of no sequence (none today) read as zeros, as in the reference.
    output = torch.zeros_like(query)
    tables, lens, starts = (_as_int32(block_tables), _as_int32(context_lens),
                            _as_int32(query_start_loc))
    check_layout(tables, lens, starts, num_tokens=num_tokens, num_blocks=k_cache.shape[0],
                 block_size=block_size)
    arguments = (query.contiguous().view(-1, head_dim).numpy(),
                 k_cache.view(-1, head_dim).numpy(), v_cache.view(-1, head_dim).numpy())
    outputs = output.view(-1, head_dim).numpy()

    def attend(first_seq: int, end_seq: int) -> None:
        _attend_rows(*arguments, tables[first_seq:end_seq], lens[first_seq:end_seq],
                     starts[first_seq:end_seq + 1], int(block_size), int(num_heads),
                     int(num_kv_heads), np.float32(scale), outputs)

    runs = split_by_work(lens, starts, torch.get_num_threads())
    helpers = [_helper_pool(len(runs) - 1).submit(attend, *run) for run in runs[1:]]
    attend(*runs[0])
    for helper in helpers:
        helper.result()
    return output


def check_layout(block_tables: np.ndarray, context_lens: np.ndarray,
                 query_start_loc: np.ndarray, *, num_tokens: int, num_blocks: int,
                 block_size: int) -> None:
    """Raise ValueError where the kernel, which trusts its indices, would read or write
    outside the tensors."""
    num_queries = np.diff(query_start_loc)
    if (len(query_start_loc) != len(context_lens) + 1 or query_start_loc[0] != 0
            or (num_queries < 0).any() or query_start_loc[-1] > num_tokens):
        raise ValueError(f"query_start_loc {query_start_loc.tolist()} does not split "
                         f"{num_tokens} tokens into {len(context_lens)} sequences")
    # A sequence of context 0 is a graph step's padding (gpu/step_packing.py): its rows
    # read as zeros, as in the varlen kernel. Any other needs a key per query.
    if ((context_lens < num_queries) & (context_lens > 0)).any():
        raise ValueError("a sequence has fewer cached tokens than queries: "
                         f"context_lens {context_lens.tolist()}, queries {num_queries.tolist()}")
    if len(context_lens) and context_lens.max() > block_tables.shape[1] * block_size:
        raise ValueError(f"context length {context_lens.max()} exceeds the block table "
                         f"({block_tables.shape[1]} blocks of {block_size})")
    if block_tables.size and (block_tables.min() < 0 or block_tables.max() >= num_blocks):
        raise ValueError(f"a block id is outside the cache's {num_blocks} blocks")


# Below this many (query, key) pairs a run is not worth a thread of its own: a pair costs
# about 0.1 us (all heads), a hand-off to a helper thread some tens of us.
MIN_PAIRS_PER_THREAD = 4096


def split_by_work(context_lens: np.ndarray, query_start_loc: np.ndarray,
                  max_runs: int) -> list[tuple[int, int]]:
    """Contiguous runs of sequences, ``(first, end)``, with about equal numbers of
    (query, key) pairs, at most ``max_runs`` and each at least MIN_PAIRS_PER_THREAD."""
    num_queries = np.diff(query_start_loc).astype(np.int64)
    pairs = np.cumsum(num_queries * context_lens.astype(np.int64))
    total = int(pairs[-1]) if len(pairs) else 0
    num_runs = max(1, min(max_runs, total // MIN_PAIRS_PER_THREAD))
    ends = [int(np.searchsorted(pairs, total * index / num_runs)) + 1
            for index in range(1, num_runs)]
    bounds = [0, *sorted({min(end, len(pairs)) for end in ends}), len(pairs)]
    runs = [(first, end) for first, end in zip(bounds, bounds[1:], strict=False) if end > first]
    return runs or [(0, 0)]


_helper_pools: dict[int, ThreadPoolExecutor] = {}
_setup_lock = threading.Lock()


def _helper_pool(num_threads: int) -> ThreadPoolExecutor:
    """A pool of ``num_threads`` helper threads, made on first use and kept."""
    with _setup_lock:
        if num_threads not in _helper_pools:
            _helper_pools[num_threads] = ThreadPoolExecutor(
                max_workers=max(num_threads, 1), thread_name_prefix="cpu-attention")
        return _helper_pools[num_threads]


def _compile_once() -> None:
    """Compile (or load) the kernel once, before any step's threads run it, so that no
    two threads compile it side by side and no step pays for it. Every call passes the
    same argument types, so there is one compilation only."""
    if not _attend_rows.signatures:
        with _setup_lock:
            if not _attend_rows.signatures:
                _run_tiny_step()


def warm_up() -> None:
    """Compile the kernel (or load it from numba's disk cache) for the executor's
    argument types: a second or so, better spent at start-up than in the first step."""
    _compile_once()


def _run_tiny_step() -> None:
    query, cache = np.zeros((1, 16), dtype=np.float32), np.zeros((1, 16), dtype=np.float32)
    ones = np.ones(1, dtype=np.int32)
    _attend_rows(query, cache, cache, np.zeros((1, 1), dtype=np.int32), ones,
                 np.array([0, 1], dtype=np.int32), 1, 1, 1, np.float32(1.0),
                 np.zeros((1, 16), dtype=np.float32))


def _as_int32(tensor: torch.Tensor) -> np.ndarray:
    """An index tensor as a contiguous int32 array: one argument type, one compilation."""
    return np.ascontiguousarray(tensor.numpy(), dtype=np.int32)
