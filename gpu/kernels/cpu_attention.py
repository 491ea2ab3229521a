"""Paged attention on the CPU: one compiled kernel for every row of a step, batch-invariant.

The kernel (numba, compiled on first use and cached on disk) walks the step's
rows, decode tokens and prefill chunks alike, straight over the paged cache
through the block tables: no Python loop over sequences, no gathered copy of
the keys and values, no padding. It implements gpu/attention.py's contract.

Batch invariance holds by construction, not by luck: a query row at position
``p`` is computed alone, by the same code, from its own query and the keys and
values at positions ``0..p``: an exact two-pass softmax (scores and their
maximum, then the exponentials and their sum, then the weighted values). The
kernel is compiled without fast-math flags, so the compiler may neither
reassociate nor fuse (no FMA) a single operation: every sum's order is the one
written here. The order depends on ``p`` and the head size only, so the row's
result is the same bits whatever else the step holds, however its prompt was
chunked, and whatever the block size or the block ids. Work is never split
across threads inside a row.

Speed comes from writing the order down in a vectorizable shape rather than
leaving it to the compiler: a dot product and the softmax's sum accumulate
16 lanes (element ``i`` into lane ``i % 16``, in order) and then fold the lanes
pairwise (LLVM vector instructions, emitted below); the exponential is a
polynomial of plain multiplies and adds (Cephes' expf), which vectorizes, where
libm's ``expf`` is a call per key.

Only float32 queries and caches whose head size is a multiple of 16 take this
path; the others go to the float64 reference (gpu/attention.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from trio_llm.gpu.attention import float64_paged_attention, write_kv_cache

__all__ = ["StepPlan", "attend", "paged_attention", "plan_step", "warm_up", "write_kv_cache"]

# Positions ahead whose keys and values are prefetched: decode reads each slot once,
# from blocks scattered over the cache, and without prefetching it waited on memory
# (in a prototype, decode over scattered blocks ran about 3x slower than over blocks
# that fit in L2; prefetching took back most of the difference).
PREFETCH_DISTANCE = 8
FLOATS_PER_CACHE_LINE = 16
# The lanes of the dot products and of the softmax's sum: one AVX-512 register of
# float32 (two AVX2 registers on a machine without AVX-512; the order is the same).
LANES = 16
# No fastmath: the order of every floating-point operation is the source's.
_kernel = numba.njit(boundscheck=False, error_model="numpy", cache=True, nogil=True)
_inlined_kernel = numba.njit(boundscheck=False, error_model="numpy", cache=True, nogil=True,
                             inline="always")

# exp(x) for x <= 0 as Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, exp(r) by a degree-7
# polynomial, 2^n put in the exponent bits. Within 1 ulp of exp over [-87.3, 0] (tested);
# below that, exp is under float32's smallest normal number, and the kernel returns 0.
EXP_LOWEST = np.float32(-87.33654)
LOG2_E = np.float32(1.44269504088896341)
LN2_HIGH = np.float32(0.693359375)
LN2_LOW = np.float32(-2.12194440e-4)
EXP_COEFFICIENTS = tuple(np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
    5.0000001201e-1))
FLOAT32_EXPONENT_BIAS = np.int32(127)
FLOAT32_MANTISSA_BITS = np.int32(23)


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

_LANE_VECTOR = ir.VectorType(ir.FloatType(), LANES)


def _lanes_pointer(context: Any, builder: Any, array_type: Any, array: Any,
                   offset: Any) -> Any:  # pragma: no cover
    """``&array[offset]`` (1D, contiguous) as a pointer to vectors of LANES floats."""
    array_struct = context.make_array(array_type)(context, builder, array)
    return builder.bitcast(builder.gep(array_struct.data, [offset]), _LANE_VECTOR.as_pointer())


def _fold_lanes(builder: Any, vector: Any) -> Any:  # pragma: no cover
    """Lane ``i`` plus lane ``i + width``, the width halving: 16 -> 8 -> 4 -> 2 -> 1."""
    width = LANES
    while width > 1:
        width //= 2
        index_type = ir.VectorType(ir.IntType(32), width)
        low = builder.shuffle_vector(vector, vector, ir.Constant(index_type, list(range(width))))
        high = builder.shuffle_vector(vector, vector,
                                      ir.Constant(index_type, list(range(width, 2 * width))))
        vector = builder.fadd(low, high)
    return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))


def _lane_sum_typing(typingctx: Any, left: Any, left_offset: Any, right: Any,
                     right_offset: Any, length: Any) -> Any:  # pragma: no cover
    """``sum(left[left_offset + i] * right[right_offset + i] for i < length)`` in one fixed
    order: 16 lanes accumulated in order from 0, then folded; ``length`` a multiple of 16.
    With ``right`` None, the plain sum of ``left``'s elements, in the same order."""
    has_right = not isinstance(right, types.NoneType)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        left_pointer = _lanes_pointer(context, builder, signature.args[0], args[0], args[1])
        right_pointer = (_lanes_pointer(context, builder, signature.args[2], args[2], args[3])
                         if has_right else None)
        total = cgutils.alloca_once_value(builder, ir.Constant(_LANE_VECTOR, [0.0] * LANES))
        num_vectors = builder.udiv(args[4], ir.Constant(args[4].type, LANES))
        with cgutils.for_range(builder, num_vectors) as loop:
            term = builder.load(builder.gep(left_pointer, [loop.index]), align=4)
            if right_pointer is not None:
                term = builder.fmul(term, builder.load(builder.gep(right_pointer, [loop.index]),
                                                       align=4))
            builder.store(builder.fadd(builder.load(total), term), total)
        return _fold_lanes(builder, builder.load(total))

    return types.float32(left, left_offset, right, right_offset, length), codegen


# ``_lane_sum(a, i, b, j, n)``: the dot product of ``a[i:i+n]`` and ``b[j:j+n]``;
# ``_lane_sum(a, i, None, 0, n)``: the sum of ``a[i:i+n]``.
_lane_sum: Any = intrinsic(_lane_sum_typing)


def _lane_max_typing(typingctx: Any, values: Any, offset: Any,
                     length: Any) -> Any:  # pragma: no cover
    """``max(values[offset:offset + length])``, ``length`` a multiple of 16, by lanes then a
    fold. A maximum is exact, so its order changes nothing (but which of +0 and -0 it
    picks, which no exponential below can tell apart)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        pointer = _lanes_pointer(context, builder, signature.args[0], args[0], args[1])
        def larger(left: Any, right: Any) -> Any:
            return builder.select(builder.fcmp_ordered(">", left, right), left, right)

        negative_infinity = ir.Constant(_LANE_VECTOR, [float("-inf")] * LANES)
        best = cgutils.alloca_once_value(builder, negative_infinity)
        num_vectors = builder.udiv(args[2], ir.Constant(args[2].type, LANES))
        with cgutils.for_range(builder, num_vectors) as loop:
            vector = builder.load(builder.gep(pointer, [loop.index]), align=4)
            builder.store(larger(builder.load(best), vector), best)
        vector = builder.load(best)
        width = LANES
        while width > 1:
            width //= 2
            index_type = ir.VectorType(ir.IntType(32), width)
            low = builder.shuffle_vector(vector, vector,
                                         ir.Constant(index_type, list(range(width))))
            high = builder.shuffle_vector(vector, vector,
                                          ir.Constant(index_type, list(range(width, 2 * width))))
            vector = larger(low, high)
        return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))

    return types.float32(values, offset, length), codegen


_lane_max: Any = intrinsic(_lane_max_typing)


def _weighted_rows_typing(typingctx: Any, weights: Any, weights_offset: Any, rows: Any,
                         row_ids: Any, row_shift: Any, num_rows: Any, row_length: Any,
                         out: Any, out_offset: Any) -> Any:  # pragma: no cover
    """``out[out_offset + d] = sum(weights[weights_offset + j] * rows[(row_ids[j] + row_shift)
    * row_length + d] for j < num_rows)``, accumulated from 0 in the order of ``j``, each
    term a multiply then an add; ``row_length`` a multiple of 16. Each 16-float slice of
    the rows is accumulated in a register over all ``j`` before the next."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        (weights_type, _, rows_type, row_ids_type, _, _, _, out_type, _) = signature.args
        (weights_array, weights_start, rows_array, row_ids_array, shift, count, length,
         out_array, out_start) = args
        weights_data = context.make_array(weights_type)(context, builder, weights_array).data
        rows_data = context.make_array(rows_type)(context, builder, rows_array).data
        row_ids_data = context.make_array(row_ids_type)(context, builder, row_ids_array).data
        int64 = ir.IntType(64)
        length = builder.sext(length, int64) if length.type != int64 else length
        lanes = ir.Constant(int64, LANES)
        total = cgutils.alloca_once(builder, _LANE_VECTOR)
        with cgutils.for_range(builder, builder.udiv(length, lanes)) as slice_loop:
            first = builder.mul(slice_loop.index, lanes)
            builder.store(ir.Constant(_LANE_VECTOR, [0.0] * LANES), total)
            with cgutils.for_range(builder, count) as row_loop:
                row_id = builder.load(builder.gep(row_ids_data, [row_loop.index]))
                row_start = builder.add(builder.mul(builder.add(row_id, shift), length), first)
                row = builder.load(builder.bitcast(builder.gep(rows_data, [row_start]),
                                                   _LANE_VECTOR.as_pointer()), align=4)
                weight = builder.load(builder.gep(weights_data,
                                                  [builder.add(weights_start, row_loop.index)]))
                splat = builder.insert_element(ir.Constant(_LANE_VECTOR, ir.Undefined), weight,
                                               ir.Constant(ir.IntType(32), 0))
                splat = builder.shuffle_vector(splat, splat,
                                               ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                                           [0] * LANES))
                builder.store(builder.fadd(builder.load(total), builder.fmul(splat, row)), total)
            out_pointer = builder.gep(context.make_array(out_type)(context, builder,
                                                                   out_array).data,
                                      [builder.add(out_start, first)])
            builder.store(builder.load(total), builder.bitcast(out_pointer,
                                                                 _LANE_VECTOR.as_pointer()),
                          align=4)
        return context.get_dummy_value()

    return types.void(weights, weights_offset, rows, row_ids, row_shift, num_rows, row_length,
                      out, out_offset), codegen


# ``_weighted_rows(w, i, rows, ids, shift, n, length, out, o)``: the weighted sum of n rows
# of ``rows`` (1D, rows of ``length``) picked by ``ids[j] + shift``, into ``out[o:o+length]``.
_weighted_rows: Any = intrinsic(_weighted_rows_typing)


def _fixed_weighted_rows(num_vectors: int, num_heads: int) -> Any:
    """``_weighted_rows`` for rows of ``num_vectors * 16`` floats and ``num_heads`` weight
    rows at once (heads of one group, which read the same rows): each head's sums in the
    same order as ``_weighted_rows``, its ``num_vectors * num_heads`` accumulators held in
    registers over all ``j``, so that they are that many independent chains of adds.
    Takes ``(weights, weights_offset, weights_stride, rows, row_ids, row_shift, num_rows,
    out, out_offset, out_stride)``: head ``h`` weighs with ``weights[weights_offset + h *
    weights_stride:]`` into ``out[out_offset + h * out_stride:]``."""
    def typing(typingctx: Any, weights: Any, weights_offset: Any, weights_stride: Any,
               rows: Any, row_ids: Any, row_shift: Any, num_rows: Any, out: Any,
               out_offset: Any, out_stride: Any) -> Any:  # pragma: no cover
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            (weights_type, _, _, rows_type, row_ids_type, _, _, out_type, _, _) = signature.args
            (weights_array, weights_start, weights_step, rows_array, row_ids_array, shift,
             count, out_array, out_start, out_step) = args
            weights_data = context.make_array(weights_type)(context, builder,
                                                            weights_array).data
            rows_data = context.make_array(rows_type)(context, builder, rows_array).data
            row_ids_data = context.make_array(row_ids_type)(context, builder,
                                                            row_ids_array).data
            out_data = context.make_array(out_type)(context, builder, out_array).data
            int64 = ir.IntType(64)
            row_length = ir.Constant(int64, num_vectors * LANES)
            zero = ir.Constant(_LANE_VECTOR, [0.0] * LANES)
            totals = [[cgutils.alloca_once_value(builder, zero) for _ in range(num_vectors)]
                      for _ in range(num_heads)]
            splat_mask = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES)
            with cgutils.for_range(builder, count) as loop:
                row_id = builder.load(builder.gep(row_ids_data, [loop.index]))
                row_pointer = builder.bitcast(
                    builder.gep(rows_data, [builder.mul(builder.add(row_id, shift),
                                                        row_length)]),
                    _LANE_VECTOR.as_pointer())
                row = [builder.load(builder.gep(row_pointer, [ir.Constant(int64, index)]),
                                    align=4) for index in range(num_vectors)]
                for head in range(num_heads):
                    offset = builder.add(builder.add(weights_start, builder.mul(
                        weights_step, ir.Constant(int64, head))), loop.index)
                    weight = builder.load(builder.gep(weights_data, [offset]))
                    splat = builder.insert_element(ir.Constant(_LANE_VECTOR, ir.Undefined),
                                                   weight, ir.Constant(ir.IntType(32), 0))
                    splat = builder.shuffle_vector(splat, splat, splat_mask)
                    for index in range(num_vectors):
                        total = totals[head][index]
                        builder.store(builder.fadd(builder.load(total),
                                                   builder.fmul(splat, row[index])), total)
            for head in range(num_heads):
                head_start = builder.add(out_start, builder.mul(out_step,
                                                                ir.Constant(int64, head)))
                out_pointer = builder.bitcast(builder.gep(out_data, [head_start]),
                                              _LANE_VECTOR.as_pointer())
                for index in range(num_vectors):
                    builder.store(builder.load(totals[head][index]),
                                  builder.gep(out_pointer, [ir.Constant(int64, index)]),
                                  align=4)
            return context.get_dummy_value()

        return types.void(weights, weights_offset, weights_stride, rows, row_ids, row_shift,
                          num_rows, out, out_offset, out_stride), codegen

    return intrinsic(typing)


# The head sizes of common models, 16 to 128 (1 to 8 vectors), one head or two at once.
_weighted_rows_1x1: Any = _fixed_weighted_rows(1, 1)
_weighted_rows_1x2: Any = _fixed_weighted_rows(1, 2)
_weighted_rows_2x1: Any = _fixed_weighted_rows(2, 1)
_weighted_rows_2x2: Any = _fixed_weighted_rows(2, 2)
_weighted_rows_4x1: Any = _fixed_weighted_rows(4, 1)
_weighted_rows_4x2: Any = _fixed_weighted_rows(4, 2)
_weighted_rows_8x1: Any = _fixed_weighted_rows(8, 1)
_weighted_rows_8x2: Any = _fixed_weighted_rows(8, 2)


def _float_from_bits_typing(typingctx: Any, bits: Any) -> Any:  # pragma: no cover
    """The float32 whose bits are the int32 ``bits``."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


_float_from_bits: Any = intrinsic(_float_from_bits_typing)


@_inlined_kernel
def _exp_nonpositive(x: np.float32) -> np.float32:  # pragma: no cover
    """exp(x) for float32 ``x <= 0`` (see EXP_COEFFICIENTS); plain arithmetic, so a loop
    of it vectorizes and every lane computes what the scalar code would."""
    is_normal = x >= EXP_LOWEST
    x = max(x, EXP_LOWEST)
    n = np.floor(x * LOG2_E + np.float32(0.5))
    r = x - n * LN2_HIGH - n * LN2_LOW
    c0, c1, c2, c3, c4, c5 = EXP_COEFFICIENTS
    p = ((((c0 * r + c1) * r + c2) * r + c3) * r + c4) * r + c5
    p = p * (r * r) + r + np.float32(1.0)
    power = _float_from_bits((np.int32(n) + FLOAT32_EXPONENT_BIAS) << FLOAT32_MANTISSA_BITS)
    return p * power if is_normal else np.float32(0.0)


@_kernel
def _exp_array(values: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out[i] = exp(values[i])`` for values <= 0, as the kernel computes it (for tests)."""
    for index in range(values.shape[0]):
        out[index] = _exp_nonpositive(values[index])


@_kernel
def _lane_dot_array(left: np.ndarray, right: np.ndarray,
                    out: np.ndarray) -> None:  # pragma: no cover
    """``out[r]``: the kernel's dot product of rows ``r`` of ``left`` and ``right`` (tests)."""
    length = left.shape[1]
    left_flat, right_flat = left.reshape(-1), right.reshape(-1)
    for row in range(left.shape[0]):
        out[row] = _lane_sum(left_flat, row * length, right_flat, row * length, length)


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
    # Room for each head's scores up to a whole number of lanes: the sum reads them all.
    scores = np.zeros((num_heads, -(-max_context_len // LANES) * LANES), dtype=np.float32)
    slot_rows = np.empty(max_context_len, dtype=np.int64)
    accumulator = np.empty((num_heads, query.shape[1]), dtype=np.float32)
    for seq_index in range(context_lens.shape[0]):
        start, end = query_start_loc[seq_index], query_start_loc[seq_index + 1]
        context_len = context_lens[seq_index]
        if end == start or context_len == 0:
            continue
        for position in range(context_len):
            block_id = block_tables[seq_index, position // block_size]
            slot_rows[position] = (block_id * block_size + position % block_size) * num_kv_heads
        # A decode row reads keys written in earlier steps, scattered over the cache: it
        # prefetches. A chunk's rows read keys that this step has just written and the
        # chunk's earlier rows have just read: prefetching them again only costs.
        prefetch_distance = PREFETCH_DISTANCE if end - start == 1 else 0
        for token in range(start, end):
            # The token's position is num_keys - 1: it sees every key up to its own.
            num_keys = context_len - (end - token) + 1
            _attend_token(query, k_rows, v_rows, slot_rows, num_keys, token * num_heads,
                          num_kv_heads, scale, prefetch_distance, scores, accumulator, out)


@_inlined_kernel
def _attend_token(query: np.ndarray, k_rows: np.ndarray, v_rows: np.ndarray,
                  slot_rows: np.ndarray, num_keys: int, first_row: int, num_kv_heads: int,
                  scale: np.float32, prefetch_distance: int, scores: np.ndarray,
                  accumulator: np.ndarray,
                  out: np.ndarray) -> None:  # pragma: no cover
    """Every head of one token (rows ``first_row..``) over keys ``0..num_keys-1``.

    Exact two-pass softmax: the scores and each head's maximum, then the exponentials
    and their sum, then the weighted values. Keys are walked in position order, all
    heads at once, so each slot's keys and values are read once, front to back.
    """
    head_dim = query.shape[1]
    num_heads = scores.shape[0]
    group_size = num_heads // num_kv_heads
    query_flat, k_flat, v_flat = query.reshape(-1), k_rows.reshape(-1), v_rows.reshape(-1)
    scores_flat, accumulator_flat = scores.reshape(-1), accumulator.reshape(-1)
    num_lane_keys = -(-num_keys // LANES) * LANES
    for key in range(num_keys):
        if prefetch_distance and key + prefetch_distance < num_keys:
            _prefetch_slot(k_flat, v_flat, slot_rows[key + prefetch_distance] * head_dim,
                           num_kv_heads * head_dim)
        for kv_head in range(num_kv_heads):
            key_start = (slot_rows[key] + kv_head) * head_dim
            for group_index in range(group_size):
                head = kv_head * group_size + group_index
                scores[head, key] = _lane_sum(query_flat, (first_row + head) * head_dim,
                                              k_flat, key_start, head_dim) * scale
    for head in range(num_heads):
        # Up to a whole number of lanes: -inf, whose exponential is 0.
        for key in range(num_keys, num_lane_keys):
            scores[head, key] = -np.inf
        maximum = _lane_max(scores_flat, head * scores.shape[1], num_lane_keys)
        for key in range(num_lane_keys):
            scores[head, key] = _exp_nonpositive(scores[head, key] - maximum)
    for kv_head in range(num_kv_heads):
        head = kv_head * group_size
        while head < (kv_head + 1) * group_size:
            num_together = 2 if head + 1 < (kv_head + 1) * group_size else 1
            _weigh_values(scores_flat, head * scores.shape[1], scores.shape[1], v_flat,
                          slot_rows, kv_head, num_keys, head_dim, num_together,
                          accumulator_flat, head * head_dim)
            head += num_together
    for head in range(num_heads):
        total = _lane_sum(scores_flat, head * scores.shape[1], None, 0, num_lane_keys)
        inverse_total = np.float32(1.0) / total
        for dim in range(head_dim):
            out[first_row + head, dim] = accumulator[head, dim] * inverse_total


@_inlined_kernel
def _weigh_values(weights: np.ndarray, weights_start: int, weights_stride: int,
                  v_flat: np.ndarray, slot_rows: np.ndarray, kv_head: int, num_keys: int,
                  head_dim: int, num_together: int, out: np.ndarray,
                  out_start: int) -> None:  # pragma: no cover
    """The weighted values of ``num_together`` (1 or 2) heads of one KV head: the register
    variant for the head size where there is one, else one head at a time. Every variant
    sums in the same order, so the choice changes no bits."""
    if num_together == 2 and head_dim == 16:
        _weighted_rows_1x2(weights, weights_start, weights_stride, v_flat, slot_rows,
                           kv_head, num_keys, out, out_start, head_dim)
    elif num_together == 2 and head_dim == 32:
        _weighted_rows_2x2(weights, weights_start, weights_stride, v_flat, slot_rows,
                           kv_head, num_keys, out, out_start, head_dim)
    elif num_together == 2 and head_dim == 64:
        _weighted_rows_4x2(weights, weights_start, weights_stride, v_flat, slot_rows,
                           kv_head, num_keys, out, out_start, head_dim)
    elif num_together == 2 and head_dim == 128:
        _weighted_rows_8x2(weights, weights_start, weights_stride, v_flat, slot_rows,
                           kv_head, num_keys, out, out_start, head_dim)
    else:
        for index in range(num_together):
            weights_at = weights_start + index * weights_stride
            out_at = out_start + index * head_dim
            if head_dim == 16:
                _weighted_rows_1x1(weights, weights_at, 0, v_flat, slot_rows, kv_head,
                                   num_keys, out, out_at, 0)
            elif head_dim == 32:
                _weighted_rows_2x1(weights, weights_at, 0, v_flat, slot_rows, kv_head,
                                   num_keys, out, out_at, 0)
            elif head_dim == 64:
                _weighted_rows_4x1(weights, weights_at, 0, v_flat, slot_rows, kv_head,
                                   num_keys, out, out_at, 0)
            elif head_dim == 128:
                _weighted_rows_8x1(weights, weights_at, 0, v_flat, slot_rows, kv_head,
                                   num_keys, out, out_at, 0)
            else:
                _weighted_rows(weights, weights_at, v_flat, slot_rows, kv_head, num_keys,
                               head_dim, out, out_at)


@_inlined_kernel
def _prefetch_slot(k_flat: np.ndarray, v_flat: np.ndarray, first: int,
                   num_floats: int) -> None:  # pragma: no cover
    """Prefetch one slot's keys and values: ``num_floats`` from offset ``first``."""
    for offset in range(first, first + num_floats, FLOATS_PER_CACHE_LINE):
        _prefetch(k_flat, offset)
        _prefetch(v_flat, offset)


def can_use_kernel(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel takes float32 tensors in the CPU's memory, heads a whole number of lanes."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and k_cache.dtype == torch.float32 and query.shape[-1] % LANES == 0)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """gpu/attention.py's paged_attention, batch-invariant; float64 reference for other dtypes
    (an FP8 cache's, with its scales)."""
    if not can_use_kernel(query, k_cache):
        return float64_paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                                       query_start_loc, scale, k_scale=k_scale, v_scale=v_scale)
    assert k_scale == v_scale == 1.0, "a float32 cache holds keys and values unscaled"
    plan = StepPlan.check(block_tables, context_lens, query_start_loc, None,
                          num_tokens=query.shape[0], num_blocks=k_cache.shape[0],
                          block_size=k_cache.shape[1])
    return attend(plan, query, k_cache, v_cache, scale)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One step's attention layout, checked once and shared by every layer: the index
    arrays as the kernel takes them, and the runs of sequences each thread computes."""

    block_tables: np.ndarray
    context_lens: np.ndarray
    query_start_loc: np.ndarray
    runs: list[tuple[int, int]]
    # int64, every slot inside the cache (or negative: not written); None if not given
    slot_mapping: torch.Tensor | None

    def part(self, part: Any) -> StepPlan:
        """The plan of sequences ``part.first_seq..part.end_seq - 1`` (their tokens
        ``part.first_token..part.end_token - 1``) as a step of their own, on one thread."""
        first_seq, end_seq = part.first_seq, part.end_seq
        starts = self.query_start_loc[first_seq:end_seq + 1] - self.query_start_loc[first_seq]
        slots = (self.slot_mapping[part.first_token:part.end_token]
                 if self.slot_mapping is not None else None)
        return StepPlan(self.block_tables[first_seq:end_seq],
                        self.context_lens[first_seq:end_seq], starts,
                        [(0, end_seq - first_seq)], slots)

    @classmethod
    def check(cls, block_tables: torch.Tensor, context_lens: torch.Tensor,
              query_start_loc: torch.Tensor, slot_mapping: torch.Tensor | None, *,
              num_tokens: int, num_blocks: int, block_size: int,
              max_runs: int | None = None) -> StepPlan:
        """Raise ValueError where the kernels, which trust their indices, would read or
        write outside the tensors."""
        tables, lens, starts = (_as_int32(block_tables), _as_int32(context_lens),
                                _as_int32(query_start_loc))
        check_layout(tables, lens, starts, num_tokens=num_tokens, num_blocks=num_blocks,
                     block_size=block_size)
        if slot_mapping is not None:
            slot_mapping = slot_mapping.to(torch.int64)
            if len(slot_mapping) != num_tokens:
                raise ValueError(f"{len(slot_mapping)} slots for {num_tokens} tokens")
            if len(slot_mapping) and int(slot_mapping.max()) >= num_blocks * block_size:
                raise ValueError(f"a slot is outside the cache's {num_blocks * block_size}")
        runs = split_by_work(lens, starts, max_runs or torch.get_num_threads())
        return cls(tables, lens, starts, runs, slot_mapping)


def plan_step(block_tables: torch.Tensor, context_lens: torch.Tensor,
              query_start_loc: torch.Tensor, slot_mapping: torch.Tensor, *, num_tokens: int,
              num_blocks: int, block_size: int, max_runs: int) -> StepPlan:
    """The StepPlan of a step whose every layer runs ``attend`` (and writes its keys and
    values at ``slot_mapping``), its sequences in up to ``max_runs`` runs on as many
    threads."""
    return StepPlan.check(block_tables, context_lens, query_start_loc, slot_mapping,
                          num_tokens=num_tokens, num_blocks=num_blocks, block_size=block_size,
                          max_runs=max_runs)


def attend(plan: StepPlan, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           scale: float) -> torch.Tensor:
    """paged_attention over a checked plan; float32 tensors (``can_use_kernel``).

    The sequences are split into as many runs of about equal work as torch had intra-op
    threads when planned, each run on its own thread (the kernel releases the GIL). A
    row is computed by one thread, the same way whichever, so the split changes no bits.
    """
    _compile_once()
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    # Rows of no sequence (none today) read as zeros, as in the reference.
    output = torch.zeros_like(query)
    arguments = (query.contiguous().view(-1, head_dim).numpy(),
                 k_cache.view(-1, head_dim).numpy(), v_cache.view(-1, head_dim).numpy())
    outputs = output.view(-1, head_dim).numpy()
    tables, lens, starts = plan.block_tables, plan.context_lens, plan.query_start_loc

    def attend_run(first_seq: int, end_seq: int) -> None:
        _attend_rows(*arguments, tables[first_seq:end_seq], lens[first_seq:end_seq],
                     starts[first_seq:end_seq + 1], int(block_size), int(num_heads),
                     int(num_kv_heads), np.float32(scale), outputs)

    runs = plan.runs
    helpers = [_helper_pool(len(runs) - 1).submit(attend_run, *run) for run in runs[1:]]
    attend_run(*runs[0])
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
