"""Triton kernels for attention over the paged KV cache (the CUDA path).

Same contract as the torch reference in trio_llm.gpu.attention:

- caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous;
- a slot is ``block_id * block_size + offset``;
- query ``i`` of sequence ``s`` sits at position ``context_len - query_len + i``
  and attends causally to every earlier position of its sequence.

Decode (one query token per sequence) groups the query heads that share a KV
head into one program, so each KV tile is read once per group, and splits long
contexts over several programs when there are too few sequences to fill the
device; a second small kernel merges the splits. Every other step (prefill
chunks and decode rows together: varlen, causal, GQA) is one launch of the
varlen kernel: one program per (block of query tokens of one sequence, KV
head), the query heads of that KV head stacked as rows. Every grid depends on
the token and sequence counts only, never on values, so any step can be
captured in a CUDA graph, and nothing here synchronizes with the host.

An FP8 cache (e4m3) holds ``key / k_scale`` and ``value / v_scale``: tiles are
widened to float16 as they are loaded (``_load_e4m3_halves``), ``k_scale`` is folded
into the softmax scale and ``v_scale`` multiplies each output row (the weighted sum
is linear in the values); a cache in the query's dtype has both scales at 1.0.

Padding for CUDA graphs: a token with a negative slot is not written, and a
sequence with context length 0 produces zeros (also for query tokens it owns:
a graph's padding tokens belong to such a sequence).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trio_llm.gpu.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_start
from trio_llm.gpu.kernels.triton_layers import as_cached
from trio_llm.gpu.quantization import E4M3

# tl.dot needs at least 16 rows: GQA groups are padded up to this.
MIN_DOT_ROWS = 16
# measured best of a sweep on an H200 (benchmarks/step_profile.py, 2026-11-30)
DECODE_BLOCK_N = 128
MAX_DECODE_SPLITS = 64
# Split until there are about this many decode programs per SM: one 4-warp program per
# SM streams too little KV to reach the copy bandwidth on a long context.
DECODE_PROGRAMS_PER_SM = 4


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tile and launch shape of the decode kernel (benchmarks/step_profile.py sweeps it)."""

    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int | None = None  # ptxas's cap a thread (None: its own choice)


DECODE_CONFIG = DecodeConfig()
# Heads wider than 128 (the hybrid family's 256) take tiles of half the positions, the
# same bytes a tile: a 128 x 256 tile spilled registers (200-408 bytes a thread to the
# stack in its sm_90 code; none at 64 positions: docs/performance.md).
DECODE_WIDE_HEAD_CONFIG = DecodeConfig(block_n=64)
# One or two sequences split their contexts MAX_DECODE_SPLITS ways: each program streams
# a tile or two, so a tile's latency, not the bandwidth, sets the time, and a bf16
# cache's heads of up to 128 take tiles of 32 positions in two warps. One sequence of
# qwen3-30b-a3b's heads on an H100, decode and merge: 4.6 us at 384 tokens against
# 5.6-5.8, 6.8 at 4,096 against 6.9 (benchmarks/decode_tiles_bench.py, two sessions,
# docs/performance.md). An e4m3 cache's gained nothing at 384 and lost 15% at 4,096;
# wide heads' were not timed at long contexts: both keep their tiles.
DECODE_SPLIT_CONFIG = DecodeConfig(block_n=32, num_warps=2, num_stages=2)
# An e4m3 cache's batches take tiles of 64 positions at 128 registers a thread: the
# default tile's 207 let an SM hold two programs, this one four. 256 sequences of
# qwen3-8b's heads on an H100: 231-232 us against 240-241 (2.51 TB/s against 2.42),
# the nano-vllm workload 1.5% faster; a bf16 cache's gained nothing (it streams at 2.96
# TB/s already), nor wide heads'. At 64 splits (one sequence of 4,096) it lost 25%, so
# one or two sequences keep the default (benchmarks/decode_tiles_bench.py,
# docs/performance.md).
DECODE_E4M3_CONFIG = DecodeConfig(block_n=64, max_registers=128)


def decode_config(head_dim: int, num_splits: int, cache_dtype: torch.dtype) -> DecodeConfig:
    """The decode tile for heads of ``head_dim`` over a cache of ``cache_dtype`` at
    ``num_splits`` splits (a function of the batch size): every batch of one split count
    takes one tile, so a sequence's result is the same bits in any of them."""
    if head_dim > 128:
        return DECODE_WIDE_HEAD_CONFIG
    if num_splits == MAX_DECODE_SPLITS:
        return DECODE_CONFIG if cache_dtype == E4M3 else DECODE_SPLIT_CONFIG
    return DECODE_E4M3_CONFIG if cache_dtype == E4M3 else DECODE_CONFIG


@dataclass(frozen=True, slots=True)
class VarlenConfig:
    """Tile and launch shape of the varlen kernel (benchmarks/kernel_bench.py sweeps it):
    ``block_m`` rows (query tokens x the query heads of one KV head), ``block_n`` KV
    positions per tile."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2


# The varlen tile by the step's token count (a graph's padded count, so a graph and the
# eager step it replaces take the same tile). Steps of a few hundred to a few thousand
# tokens are mostly decode rows and short prompts, and a decode row fills only its
# group's rows of a program: on a step of 256 decode rows and three 128-token prompts
# 64 x 64 takes 104 us against 194 for 128 x 128, and 2000 x (128 in, 64..192 out) went
# from 32,334 to 49,254 tok/s. A long chunk (8,192 tokens at a 32k context) runs 5%
# faster on 128 x 128 (H200, 2026-12-01, docs/performance.md (f), second pass).
VARLEN_SMALL_CONFIG = VarlenConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
VARLEN_LARGE_CONFIG = VarlenConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
VARLEN_SMALL_MAX_TOKENS = 4096
# Heads wider than 128 (the hybrid family's 256) take one tile at every token count: the
# large tile's query, key and value need 320 KiB of shared memory there, past the
# H200's 227, and the small one spilled registers (80-192 bytes a thread). 32 positions
# a tile spill less (none over a bf16 cache, 40 bytes over an FP8 one at qwen3.5-27b's
# heads) and ran fastest of five tiles on the H100 over both caches: an 8,192-token
# chunk at a 32k context 8-19% faster than 64 x 64, 8 prompts of 1,024 and a mixed
# step 23-30% (benchmarks/varlen_wide_heads.py, docs/performance.md).
VARLEN_WIDE_HEAD_CONFIG = VarlenConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)


def varlen_config(num_tokens: int, head_dim: int = 128) -> VarlenConfig:
    """The varlen tile of a step of ``num_tokens`` tokens and heads of ``head_dim``."""
    if head_dim > 128:
        return VARLEN_WIDE_HEAD_CONFIG
    if num_tokens <= VARLEN_SMALL_MAX_TOKENS:
        return VARLEN_SMALL_CONFIG
    return VARLEN_LARGE_CONFIG


# Compiled, an e4m3 pair widens in one PTX conversion; Triton's interpreter (CI on the
# CPU) runs no PTX, and widens each byte by Triton's own cast (the same values).
_WIDEN_IN_PTX: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")

# exp(x) = exp2(x * log2(e)): the kernels fold log2(e) into the softmax scale, so each
# score costs one fused multiply-add before its exp2 (as FlashAttention-2 does).
LOG2_E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    key_token_stride, key_head_stride, value_token_stride, value_head_stride, k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_D: tl.constexpr, QUANTIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM) & (slot >= 0)
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    key = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, as_cached(key, k_scale, k_cache_ptr, QUANTIZE),
             mask=mask)
    value = tl.load(value_ptr + token * value_token_stride + heads * value_head_stride + dims,
                    mask=mask)
    tl.store(v_cache_ptr + cache_offsets, as_cached(value, v_scale, v_cache_ptr, QUANTIZE),
             mask=mask)


@triton.jit
def _kv_slots(block_table_row_ptr, positions, position_mask, BLOCK_SIZE: tl.constexpr,
              MASKED: tl.constexpr):
    """The cache slots of ``positions`` of one sequence, shared by its key and value tile."""
    if MASKED:
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=position_mask,
                            other=0)
    else:
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE)
    return block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE


@triton.jit
def _load_kv_tile(cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                  EVEN_D: tl.constexpr):
    """One KV head's [BLOCK_N, BLOCK_D] tile of the cache at ``slots``; positions past the
    end read zeros when ``MASKED``, and padded head dimensions always do. (A tile wholly
    inside the context loads without a mask.) An e4m3 cache's tile comes widened to
    float16."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        tile = _load_e4m3_tile(cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS,
                               HEAD_DIM, BLOCK_D, MASKED, EVEN_D)
    else:
        dims = tl.arange(0, BLOCK_D)
        tile = _load_rows(cache_ptr + slots[:, None] * (NUM_KV_HEADS * HEAD_DIM)
                          + kv_head * HEAD_DIM + dims[None, :], position_mask, dims < HEAD_DIM,
                          MASKED, EVEN_D)
    return tile


@triton.jit
def _load_rows(ptrs, position_mask, column_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A tile at ``ptrs``, zeros at masked positions (``MASKED``) and columns."""
    if MASKED:
        tile = tl.load(ptrs, mask=position_mask[:, None] & column_mask[None, :], other=0)
    elif EVEN_D:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=column_mask[None, :], other=0)
    return tile


@triton.jit
def _load_e4m3_halves(cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                      EVEN_D: tl.constexpr):
    """An e4m3 tile as two float16 tiles, its even and its odd head dimensions, read as
    16-bit words of two values each and widened a pair at a time.

    Loaded as bytes, the tile became the dots' operands before it was widened: the
    value tile's bytes were read from shared memory one at a time (an 8-bit operand
    has no transposing matrix load) and the key's through byte shuffles. Widened words
    reach the dots as 16-bit data, as a bf16 cache's do. Joined back into one tile
    (_load_e4m3_tile) they cost a register move a value; the decode kernel, the one
    that reads the whole cache each step, takes the halves as they come
    (_decode_halves): 13% faster at 256 sequences than the joined tile, which read an
    FP8 cache no faster than the byte loads (H100, docs/performance.md)."""
    words = tl.arange(0, BLOCK_D // 2)
    pairs = _load_rows(cache_ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
                       + slots[:, None] * (NUM_KV_HEADS * HEAD_DIM // 2)
                       + kv_head * (HEAD_DIM // 2) + words[None, :], position_mask,
                       words < HEAD_DIM // 2, MASKED, EVEN_D)
    if _WIDEN_IN_PTX:
        # the low byte (the lower address, an even dimension) to the low half
        widened = tl.inline_asm_elementwise("cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h", [pairs],
                                            dtype=tl.uint32, is_pure=True, pack=1)
        even = (widened & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        odd = (widened >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        even = (pairs & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        odd = (pairs >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return even, odd


@triton.jit
def _load_e4m3_tile(cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
                    EVEN_D: tl.constexpr):
    """An e4m3 tile as one float16 tile: its halves joined (the varlen kernel's; the
    decode kernel keeps them apart, _decode_halves)."""
    even, odd = _load_e4m3_halves(cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS,
                                  HEAD_DIM, BLOCK_D, MASKED, EVEN_D)
    return tl.reshape(tl.join(even, odd), [slots.shape[0], BLOCK_D])


@triton.jit
def _dot_query(query, k_cache_ptr):
    """The query as the tile's dots take it. Over an FP8 cache a bf16 query becomes
    float16, and so do the keys, values and probabilities it meets: e4m3 widens to
    float16 in one conversion a pair of values on sm_90, to bfloat16 in three, and the
    conversions, not the bytes, bounded the decode kernel (docs/performance.md). An e4m3
    value and a probability are exact in float16, a bf16 query too from 2^-14 to 65504
    (clamped there: float16 has no larger values)."""
    operand = query
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and query.dtype == tl.bfloat16:
        operand = tl.clamp(query.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return operand


@triton.jit
def _tokens_per_split(context_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each split's share of a context: whole tiles, the last split taking the rest."""
    return tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


# Which keys of a tile _attend_tile hides: none (a tile wholly inside every query's
# past), those at or past ``end`` (a decode row's last tile), or also those after each
# query's own position (a prefill tile on the diagonal).
MASK_NONE: tl.constexpr = tl.constexpr(0)
MASK_END: tl.constexpr = tl.constexpr(1)
MASK_CAUSAL: tl.constexpr = tl.constexpr(2)


@triton.jit
def _attend_tile(query, k_cache_ptr, v_cache_ptr, block_table_row_ptr, tile_start, end,
                 query_positions, kv_head, dims, qk_scale, running_max, running_sum,
                 acc, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                 EVEN_D: tl.constexpr):
    """One KV tile of the online softmax, the one loop body of both kernels;
    ``query_positions`` is read only with ``MASK_CAUSAL``. Maxima are kept in log2
    units (scores times ``qk_scale``, the softmax scale times log2(e)), so that each
    probability is one exp2."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    position_mask = positions < end
    masked = MASK != MASK_NONE
    slots = _kv_slots(block_table_row_ptr, positions, position_mask, BLOCK_SIZE, masked)
    key = _load_kv_tile(k_cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS, HEAD_DIM,
                        dims.shape[0], masked, EVEN_D)
    value = _load_kv_tile(v_cache_ptr, slots, position_mask, kv_head, NUM_KV_HEADS, HEAD_DIM,
                          dims.shape[0], masked, EVEN_D)
    return _attend_loaded(query, key, value, positions, position_mask, query_positions,
                          qk_scale, running_max, running_sum, acc, MASK)


@triton.jit
def _attend_loaded(query, key, value, positions, position_mask, query_positions, qk_scale,
                   running_max, running_sum, acc, MASK: tl.constexpr):
    """_attend_tile's arithmetic on a key and a value tile already loaded."""
    scores = tl.dot(query, tl.trans(key.to(query.dtype)))
    if MASK == MASK_CAUSAL:
        visible = (positions[None, :] <= query_positions[:, None]) & position_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    elif MASK == MASK_END:
        scores = tl.where(position_mask[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1) * qk_scale)
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores * qk_scale - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(query.dtype), value.to(query.dtype))
    return new_max, running_sum, acc


@triton.jit
def _early_tile(block_table_row_ptr, start, full_end, context_len, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """The decode kernel's early tile under PDL: (its end, positions, mask, slots).
    Launched while the kernels before run, the kernel finds of this step's keys and
    values only the last position's (context_len - 1) written by them (the KV write
    before it); earlier steps wrote the rest. So a first tile wholly before it is
    fetched before waiting, its latency hidden behind theirs; none (end = start) if the
    split has no such tile."""
    early_end = tl.where(start + BLOCK_N <= tl.minimum(full_end, context_len - 1),
                         start + BLOCK_N, start)
    positions = start + tl.arange(0, BLOCK_N)
    early_mask = positions < early_end
    slots = _kv_slots(block_table_row_ptr, positions, early_mask, BLOCK_SIZE, True)
    return early_end, positions, early_mask, slots


@triton.jit
def _decode_tiles(query_ptr, k_cache_ptr, v_cache_ptr, block_table_row_ptr, seq, kv_head,
                  start, end, full_end, context_len, qk_scale, query_token_stride,
                  query_head_stride, NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                  USE_PDL: tl.constexpr):
    """The decode kernel's loop: whole tiles unmasked, then the partial last tile (if
    any) masked at the end."""
    dims = tl.arange(0, BLOCK_D)
    if USE_PDL:
        early_end, positions, early_mask, slots = _early_tile(
            block_table_row_ptr, start, full_end, context_len, BLOCK_SIZE, BLOCK_N)
        early_key = _load_kv_tile(k_cache_ptr, slots, early_mask, kv_head, NUM_KV_HEADS,
                                  HEAD_DIM, BLOCK_D, True, EVEN_D)
        early_value = _load_kv_tile(v_cache_ptr, slots, early_mask, kv_head, NUM_KV_HEADS,
                                    HEAD_DIM, BLOCK_D, True, EVEN_D)
        gdc_wait()

    heads = kv_head * GROUP_SIZE + tl.arange(0, BLOCK_H)
    io_mask = (tl.arange(0, BLOCK_H) < GROUP_SIZE)[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(query_ptr + seq * query_token_stride + heads[:, None] * query_head_stride
                    + dims[None, :], mask=io_mask, other=0.0)
    query = _dot_query(query, k_cache_ptr)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    first_tile = start
    if USE_PDL:
        if early_end > start:
            running_max, running_sum, acc = _attend_loaded(
                query, early_key, early_value, positions, early_mask, 0, qk_scale,
                running_max, running_sum, acc, MASK_NONE)
        first_tile = early_end
    for tile_start in range(first_tile, full_end, BLOCK_N):
        running_max, running_sum, acc = _attend_tile(
            query, k_cache_ptr, v_cache_ptr, block_table_row_ptr, tile_start, end,
            0, kv_head, dims, qk_scale, running_max, running_sum, acc,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_NONE, EVEN_D)
    if full_end < end:
        running_max, running_sum, acc = _attend_tile(
            query, k_cache_ptr, v_cache_ptr, block_table_row_ptr, full_end, end,
            0, kv_head, dims, qk_scale, running_max, running_sum, acc,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_END, EVEN_D)
    return running_max, running_sum, acc


@triton.jit
def _attend_halves(q_even, q_odd, k_cache_ptr, v_cache_ptr, block_table_row_ptr, tile_start,
                   end, kv_head, qk_scale, running_max, running_sum, acc_even, acc_odd,
                   NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """_attend_tile over an e4m3 cache in even and odd head dimensions (decode)."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    position_mask = positions < end
    slots = _kv_slots(block_table_row_ptr, positions, position_mask, BLOCK_SIZE, MASKED)
    k_even, k_odd = _load_e4m3_halves(k_cache_ptr, slots, position_mask, kv_head,
                                      NUM_KV_HEADS, HEAD_DIM, BLOCK_D, MASKED, EVEN_D)
    v_even, v_odd = _load_e4m3_halves(v_cache_ptr, slots, position_mask, kv_head,
                                      NUM_KV_HEADS, HEAD_DIM, BLOCK_D, MASKED, EVEN_D)
    return _attend_loaded_halves(q_even, q_odd, k_even, k_odd, v_even, v_odd, position_mask,
                                 qk_scale, running_max, running_sum, acc_even, acc_odd,
                                 MASKED)


@triton.jit
def _attend_loaded_halves(q_even, q_odd, k_even, k_odd, v_even, v_odd, position_mask,
                          qk_scale, running_max, running_sum, acc_even, acc_odd,
                          MASKED: tl.constexpr):
    """_attend_loaded in halves: a score is q_even . k_even + q_odd . k_odd, and each half
    of the values adds to its own accumulator."""
    dtype = q_even.dtype  # float16 on a GPU (_dot_query); float32 in the interpreter
    scores = tl.dot(q_odd, tl.trans(k_odd.to(dtype)),
                    acc=tl.dot(q_even, tl.trans(k_even.to(dtype))))
    if MASKED:
        scores = tl.where(position_mask[None, :], scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, 1) * qk_scale)
    rescale = tl.exp2(running_max - new_max)
    probs = tl.exp2(scores * qk_scale - new_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, 1)
    probs = probs.to(dtype)
    acc_even = acc_even * rescale[:, None] + tl.dot(probs, v_even.to(dtype))
    acc_odd = acc_odd * rescale[:, None] + tl.dot(probs, v_odd.to(dtype))
    return new_max, running_sum, acc_even, acc_odd


@triton.jit
def _decode_halves(query_ptr, k_cache_ptr, v_cache_ptr, block_table_row_ptr, seq, kv_head,
                   start, end, full_end, context_len, qk_scale, query_token_stride,
                   query_head_stride, NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """The decode kernel's loop over an e4m3 cache, in even and odd head dimensions
    (_load_e4m3_halves), with its early tile as the kernel's."""
    if USE_PDL:
        early_end, positions, early_mask, slots = _early_tile(
            block_table_row_ptr, start, full_end, context_len, BLOCK_SIZE, BLOCK_N)
        early_k_even, early_k_odd = _load_e4m3_halves(
            k_cache_ptr, slots, early_mask, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, True,
            EVEN_D)
        early_v_even, early_v_odd = _load_e4m3_halves(
            v_cache_ptr, slots, early_mask, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_D, True,
            EVEN_D)
        gdc_wait()

    halves = tl.arange(0, BLOCK_D // 2)
    heads = kv_head * GROUP_SIZE + tl.arange(0, BLOCK_H)
    q_mask = (tl.arange(0, BLOCK_H) < GROUP_SIZE)[:, None] & (halves < HEAD_DIM // 2)[None, :]
    q_even_ptrs = (query_ptr + seq * query_token_stride + heads[:, None] * query_head_stride
                   + 2 * halves[None, :])
    q_even = _dot_query(tl.load(q_even_ptrs, mask=q_mask, other=0.0), k_cache_ptr)
    q_odd = _dot_query(tl.load(q_even_ptrs + 1, mask=q_mask, other=0.0), k_cache_ptr)

    running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_H], tl.float32)
    acc_even = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
    acc_odd = tl.zeros([BLOCK_H, BLOCK_D // 2], tl.float32)
    first_tile = start
    if USE_PDL:
        if early_end > start:
            running_max, running_sum, acc_even, acc_odd = _attend_loaded_halves(
                q_even, q_odd, early_k_even, early_k_odd, early_v_even, early_v_odd,
                early_mask, qk_scale, running_max, running_sum, acc_even, acc_odd, False)
        first_tile = early_end
    for tile_start in range(first_tile, full_end, BLOCK_N):
        running_max, running_sum, acc_even, acc_odd = _attend_halves(
            q_even, q_odd, k_cache_ptr, v_cache_ptr, block_table_row_ptr, tile_start, end,
            kv_head, qk_scale, running_max, running_sum, acc_even, acc_odd, NUM_KV_HEADS,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, EVEN_D)
    if full_end < end:
        running_max, running_sum, acc_even, acc_odd = _attend_halves(
            q_even, q_odd, k_cache_ptr, v_cache_ptr, block_table_row_ptr, full_end, end,
            kv_head, qk_scale, running_max, running_sum, acc_even, acc_odd, NUM_KV_HEADS,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, EVEN_D)
    return running_max, running_sum, acc_even, acc_odd


@triton.jit
def _store_columns(out_ptr, partial_acc_ptr, acc, running_sum, v_scale, seq, heads,
                   split_index, columns, io_mask, out_token_stride, out_head_stride,
                   HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A decode program's accumulated ``columns``: normalized into the output (one split)
    or as they are into its split's partial accumulator."""
    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None] * v_scale
        tl.store(out_ptr + seq * out_token_stride + heads[:, None] * out_head_stride
                 + columns[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        tl.store(partial_acc_ptr + split_index[:, None] * HEAD_DIM + columns[None, :], acc,
                 mask=io_mask)


@triton.jit
def _decode_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, qk_scale, v_scale,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride,
    block_table_stride,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:
        gdc_launch_dependents()  # gpu/kernels/pdl.py; the wait comes below
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)  # a step input: no kernel of the chain writes it
    tokens_per_split = _tokens_per_split(context_len, NUM_SPLITS, BLOCK_N)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    if NUM_SPLITS > 1:
        if start >= end:
            return  # an empty split: the merge leaves it out
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * block_table_stride
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        running_max, running_sum, acc_even, acc_odd = _decode_halves(
            query_ptr, k_cache_ptr, v_cache_ptr, block_table_row_ptr, seq, kv_head, start,
            end, full_end, context_len, qk_scale, query_token_stride, query_head_stride,
            NUM_KV_HEADS, GROUP_SIZE, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_N, BLOCK_D,
            EVEN_D, USE_PDL)
    else:
        running_max, running_sum, acc = _decode_tiles(
            query_ptr, k_cache_ptr, v_cache_ptr, block_table_row_ptr, seq, kv_head, start,
            end, full_end, context_len, qk_scale, query_token_stride, query_head_stride,
            NUM_KV_HEADS, GROUP_SIZE, HEAD_DIM, BLOCK_SIZE, BLOCK_H, BLOCK_N, BLOCK_D,
            EVEN_D, USE_PDL)

    row_mask = tl.arange(0, BLOCK_H) < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + tl.arange(0, BLOCK_H)
    # partials: [num_seqs, NUM_HEADS, NUM_SPLITS] and [..., HEAD_DIM]
    split_index = (seq * NUM_HEADS + heads) * NUM_SPLITS + split
    if NUM_SPLITS > 1:
        tl.store(partial_max_ptr + split_index, running_max, mask=row_mask)
        tl.store(partial_sum_ptr + split_index, running_sum, mask=row_mask)
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        halves = tl.arange(0, BLOCK_D // 2)
        io_mask = row_mask[:, None] & (halves < HEAD_DIM // 2)[None, :]
        _store_columns(out_ptr, partial_acc_ptr, acc_even, running_sum, v_scale, seq, heads,
                       split_index, 2 * halves, io_mask, out_token_stride, out_head_stride,
                       HEAD_DIM, NUM_SPLITS)
        _store_columns(out_ptr, partial_acc_ptr, acc_odd, running_sum, v_scale, seq, heads,
                       split_index, 2 * halves + 1, io_mask, out_token_stride,
                       out_head_stride, HEAD_DIM, NUM_SPLITS)
    else:
        dims = tl.arange(0, BLOCK_D)
        io_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
        _store_columns(out_ptr, partial_acc_ptr, acc, running_sum, v_scale, seq, heads,
                       split_index, dims, io_mask, out_token_stride, out_head_stride,
                       HEAD_DIM, NUM_SPLITS)


@triton.jit
def _merge_splits_kernel(
    out_ptr, partial_acc_ptr, partial_max_ptr, partial_sum_ptr, context_lens_ptr, v_scale,
    out_token_stride, out_head_stride,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # the splits the decode kernel computed (it returns early on empty ones)
    context_len = tl.load(context_lens_ptr + seq)
    tokens_per_split = _tokens_per_split(context_len, NUM_SPLITS, BLOCK_N)
    num_computed = tl.cdiv(context_len, tl.maximum(tokens_per_split, 1))
    splits = tl.arange(0, BLOCK_SPLITS)
    split_mask = splits < num_computed
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    split_index = (seq * NUM_HEADS + head) * NUM_SPLITS + splits
    split_max = tl.load(partial_max_ptr + split_index, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + split_index, mask=split_mask, other=0.0)
    split_acc = tl.load(partial_acc_ptr + split_index[:, None] * HEAD_DIM + dims[None, :],
                        mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    overall_max = tl.max(split_max, 0)
    # Empty splits (and padded sequences, where every split is empty) weigh 0.
    overall_max = tl.where(overall_max == float("-inf"), 0.0, overall_max)
    # (the maxima are in log2 units, see _attend_tile)
    weights = tl.where(split_sum > 0, tl.exp2(split_max - overall_max), 0.0)
    total = tl.sum(split_sum * weights, 0)
    out = tl.sum(split_acc * weights[:, None], 0) / tl.where(total > 0, total, 1.0) * v_scale
    tl.store(out_ptr + seq * out_token_stride + head * out_head_stride + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


@triton.jit
def _find_sequence(query_start_loc_ptr, program, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold ``program``: the last ``s`` with
    ``query_start_loc[s] // BLOCK_Q + s <= program`` (binary search)."""
    low = 0
    high = num_seqs
    while low < high:
        middle = (low + high) // 2
        first_block = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        if first_block <= program:
            low = middle + 1
        else:
            high = middle
    return low - 1


@triton.jit
def _varlen_kernel(
    query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    query_start_loc_ptr, out_ptr, qk_scale, v_scale, num_seqs,
    query_token_stride, query_head_stride, out_token_stride, out_head_stride,
    block_table_stride,
    NUM_KV_HEADS: tl.constexpr, GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
):
    # Program p owns BLOCK_Q query tokens of one sequence, for the GROUP_SIZE query
    # heads that share one KV head: BLOCK_M = BLOCK_Q x GROUP_SIZE rows (padded), so
    # each KV tile is read once per group. Sequence s's blocks start at program
    # query_start_loc[s] // BLOCK_Q + s; that bound makes the grid
    # num_tokens // BLOCK_Q + num_seqs whatever the query lengths are. Programs run
    # in reverse: a sequence's last query blocks, which see the most keys, start
    # first, so the short ones fill the tail of the launch (the work of each program
    # is the same whatever the order).
    program = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, program, num_seqs, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    query_block = program - (query_start // BLOCK_Q + seq)
    if query_block * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    query_index = query_block * BLOCK_Q + rows // GROUP_SIZE
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE
    row_mask = (rows < BLOCK_Q * GROUP_SIZE) & (query_index < query_len)
    # Masked rows keep a position inside the context, so no row is all -inf (no NaN).
    query_positions = context_len - query_len + query_index
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    tokens = (query_start + query_index).to(tl.int64)
    query = tl.load(query_ptr + tokens[:, None] * query_token_stride
                    + heads[:, None] * query_head_stride + dims[None, :], mask=io_mask,
                    other=0.0)
    query = _dot_query(query, k_cache_ptr)
    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * block_table_stride

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The last query of this block sees positions up to its own; nothing beyond. A
    # padding sequence (context 0) reads nothing and writes zeros.
    last_query = tl.minimum(query_len, (query_block + 1) * BLOCK_Q) - 1
    end = tl.minimum(context_len, context_len - query_len + last_query + 1)
    # Tiles wholly at or before the block's first query position need no causal mask.
    # (Clamped at 0: a padding sequence's positions are negative, and no tile may start
    # below 0.)
    first_position = context_len - query_len + query_block * BLOCK_Q
    unmasked_end = tl.maximum(tl.minimum((first_position + 1) // BLOCK_N * BLOCK_N, end), 0)
    for tile_start in range(0, unmasked_end, BLOCK_N):
        running_max, running_sum, acc = _attend_tile(
            query, k_cache_ptr, v_cache_ptr, block_table_row_ptr, tile_start, end,
            query_positions, kv_head, dims, qk_scale, running_max, running_sum, acc,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_NONE, EVEN_D)
    for tile_start in range(unmasked_end, end, BLOCK_N):
        running_max, running_sum, acc = _attend_tile(
            query, k_cache_ptr, v_cache_ptr, block_table_row_ptr, tile_start, end,
            query_positions, kv_head, dims, qk_scale, running_max, running_sum, acc,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_CAUSAL, EVEN_D)

    out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None] * v_scale
    tl.store(out_ptr + tokens[:, None] * out_token_stride + heads[:, None] * out_head_stride
             + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Store this step's keys and values at their slots (an FP8 cache: divided by their
    scales); a negative slot is skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert key.stride(2) == 1 and value.stride(2) == 1
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_scale, v_scale,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), QUANTIZE=k_cache.dtype == E4M3,
    )


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *,
                    k_scale: float = 1.0, v_scale: float = 1.0,
                    num_splits: int | None = None,
                    varlen: VarlenConfig | None = None,
                    decode: DecodeConfig | None = None) -> torch.Tensor:
    """Causal attention of ``query`` over the paged cache -> [num_tokens, num_heads, head_dim].

    A batch with as many tokens as sequences is decode-only (every sequence has
    at least one query token) and takes the decode kernel; ``num_splits``
    overrides its split count (which otherwise depends on the batch size only),
    ``decode`` its tile (``decode_config`` otherwise). Any other batch, prefill
    chunks and decode rows together, is one launch of the varlen kernel, whose grid
    depends on the token and sequence counts only; ``varlen`` overrides its tile
    (``varlen_config(num_tokens)`` otherwise). ``k_scale``/``v_scale``: an FP8 cache's.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    assert query.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype != E4M3 or head_dim % 2 == 0, "an e4m3 cache is read in pairs"
    # an FP8 cache's key scale multiplies every score: folded into the softmax scale
    qk_scale = scale * LOG2_E * k_scale
    if num_tokens == num_seqs:
        splits = num_splits or decode_num_splits(num_seqs, k_cache.shape[2], query.device)
        _decode(query, k_cache, v_cache, block_tables, context_lens, (qk_scale, v_scale), out,
                splits, decode or decode_config(head_dim, splits, k_cache.dtype))
    else:
        _varlen(query, k_cache, v_cache, block_tables, context_lens, query_start_loc,
                (qk_scale, v_scale), out, varlen or varlen_config(num_tokens, query.shape[-1]))
    return out


def varlen_tiling(group_size: int, block_m: int) -> tuple[int, int]:
    """(rows, query tokens) per program of the varlen kernel: its rows are a block of
    query tokens times the ``group_size`` query heads that share a KV head."""
    block_m = max(block_m, MIN_DOT_ROWS, triton.next_power_of_2(group_size))
    return block_m, block_m // group_size


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Split the context over more programs only when sequences x KV heads leave SMs idle.

    The count depends on the batch size only (so a captured decode graph has one);
    each split takes whole tiles of the decode tile's ``block_n`` positions, so a context
    uses ``min(count, cdiv(context, block_n))`` splits (the others return at once): in
    effect a rule on (sequences, context). The result for a sequence is the same bits
    in any batch of the same split count, and within rounding (the merge's float32
    sums) across split counts.
    """
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    num_programs = num_seqs * num_kv_heads
    if num_programs >= num_sms:
        return 1
    return min(MAX_DECODE_SPLITS, triton.cdiv(DECODE_PROGRAMS_PER_SM * num_sms, num_programs))


def _decode(query, k_cache, v_cache, block_tables, context_lens, scales, out, num_splits,
            config):
    qk_scale, v_scale = scales
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    if num_splits > 1:
        partial_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim),
                                  dtype=torch.float32, device=query.device)
        partial_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                                  device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_acc = partial_max = partial_sum = out  # unused by the kernel
    block_d = triton.next_power_of_2(head_dim)
    pdl = pdl_launch(query.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens,
        out, partial_acc, partial_max, partial_sum, qk_scale, v_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP_SIZE=group_size,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_H=max(MIN_DOT_ROWS, triton.next_power_of_2(group_size)),
        BLOCK_N=config.block_n, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        num_warps=config.num_warps, num_stages=config.num_stages,
        maxnreg=config.max_registers, **pdl,
    )
    if num_splits > 1:
        block_splits = triton.next_power_of_2(num_splits)
        _merge_splits_kernel[(num_seqs, num_heads)](
            out, partial_acc, partial_max, partial_sum, context_lens, v_scale, out.stride(0),
            out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_SPLITS=block_splits, BLOCK_D=block_d, BLOCK_N=config.block_n,
            # a program holds every split's partial row: 128 floats a thread at most
            num_warps=max(2, block_splits * block_d // (32 * 128)), **pdl,
        )


def _varlen(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scales, out,
            config):
    qk_scale, v_scale = scales
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    block_m, block_q = varlen_tiling(group_size, config.block_m)
    block_d = triton.next_power_of_2(head_dim)
    # sequence s's query blocks start at query_start_loc[s] // block_q + s (see the kernel)
    _varlen_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        query, k_cache, v_cache, block_tables, context_lens, query_start_loc, out, qk_scale,
        v_scale, num_seqs, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP_SIZE=group_size, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=config.block_n, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
