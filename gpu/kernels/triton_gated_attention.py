"""Triton kernels of the hybrid family's full-attention layers (Qwen3.5, Qwen3-Next).

Their attention differs from Qwen3's in three ways (gpu/layers/attention.py's
``forward`` is the reference): q_proj gives each head its queries followed by as
many output-gate values; the q/k norms are of the ``(1 + weight)`` form, applied
in float32 and rounded once; and only the first ``rotary_dim`` entries of a head
rotate (a quarter of 256), the rest pass through.

- ``gated_qk_norm_rope_write_kv``: from the fused qkv projection, the normed and
  partly rotated queries, and keys and values stored into the paged cache (an FP8
  cache: over their scales);
- ``sigmoid_gate``: the attention output times the sigmoid of the gate values,
  read in place from the projection.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trio_llm.gpu.kernels.pdl import pdl_launch, pdl_start
from trio_llm.gpu.kernels.triton_layers import as_cached, rotate_halves
from trio_llm.gpu.quantization import E4M3, KVScales

GATE_BLOCK = 1024


@triton.jit
def _gated_qk_kernel(qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
                     query_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, qkv_row_stride,
                     k_scale, v_scale, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
                     QUANTIZE_KV: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    is_query = head < NUM_HEADS
    dims = tl.arange(0, HEAD_DIM)
    half_dims = tl.arange(0, ROTARY_DIM // 2)
    # per query head: its queries then its gate values; key heads after the query heads
    source = qkv_ptr + token * qkv_row_stride + head * 2 * HEAD_DIM
    norm_ptr = q_norm_ptr
    if not is_query:
        source = qkv_ptr + token * qkv_row_stride + NUM_HEADS * 2 * HEAD_DIM \
            + (head - NUM_HEADS) * HEAD_DIM
        norm_ptr = k_norm_ptr
    x = tl.load(source + dims).to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
    dtype = query_out_ptr.dtype.element_ty
    # (1 + weight) in float32, one rounding at the end (transformers' Qwen3_5RMSNorm)
    normed = (x * inverse * (1.0 + tl.load(norm_ptr + dims).to(tl.float32))).to(dtype)
    first = (tl.load(source + half_dims).to(tl.float32) * inverse
             * (1.0 + tl.load(norm_ptr + half_dims).to(tl.float32))).to(dtype)
    second = (tl.load(source + ROTARY_DIM // 2 + half_dims).to(tl.float32) * inverse
              * (1.0 + tl.load(norm_ptr + ROTARY_DIM // 2 + half_dims).to(tl.float32))
              ).to(dtype)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # the table repeats its ROTARY_DIM // 2 angles: both halves use the first
    cos = tl.load(cos_ptr + position * ROTARY_DIM + half_dims).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + position * ROTARY_DIM + half_dims).to(dtype).to(tl.float32)
    first, second = rotate_halves(first, second, cos, sin)
    passes = dims >= ROTARY_DIM
    if is_query:
        target = query_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(target + dims, normed, mask=passes)
        tl.store(target + half_dims, first)
        tl.store(target + ROTARY_DIM // 2 + half_dims, second)
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            offset = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + offset + dims,
                     as_cached(normed, k_scale, k_cache_ptr, QUANTIZE_KV), mask=passes)
            tl.store(k_cache_ptr + offset + half_dims,
                     as_cached(first, k_scale, k_cache_ptr, QUANTIZE_KV))
            tl.store(k_cache_ptr + offset + ROTARY_DIM // 2 + half_dims,
                     as_cached(second, k_scale, k_cache_ptr, QUANTIZE_KV))
            value = tl.load(source + NUM_KV_HEADS * HEAD_DIM + dims)
            tl.store(v_cache_ptr + offset + dims,
                     as_cached(value, v_scale, v_cache_ptr, QUANTIZE_KV))


def gated_qk_norm_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor,
                                eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_mapping: torch.Tensor, *, num_heads: int,
                                num_kv_heads: int, head_dim: int,
                                kv_scales: KVScales | None = None) -> torch.Tensor:
    """From the fused projection [tokens, heads * 2 head_dim + 2 kv_heads * head_dim]
    (each query head's queries, then its gate values): the normed queries, their first
    ``cos.shape[1]`` entries rotated, [tokens, heads, head_dim]; keys (normed, rotated)
    and values go to the cache at ``slot_mapping`` (-1: nowhere; an FP8 cache holds them
    divided by ``kv_scales``, as gpu/attention.py's ``write_kv_cache`` stores them).
    ``q_norm`` and ``k_norm`` are the checkpoint's weights (the norm scales by
    ``1 + weight``)."""
    kv_scales = kv_scales or KVScales()
    num_tokens = qkv.shape[0]
    rotary_dim = cos.shape[1]
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    assert qkv.stride(1) == 1 and cos.is_contiguous() and k_cache.is_contiguous()
    assert triton.next_power_of_2(head_dim) == head_dim and rotary_dim % 2 == 0
    assert triton.next_power_of_2(rotary_dim) == rotary_dim and rotary_dim <= head_dim
    pdl = pdl_launch(qkv.device)
    _gated_qk_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q_norm, k_norm, eps, query, k_cache, v_cache, slot_mapping,
        qkv.stride(0), kv_scales.k_scale, kv_scales.v_scale, NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        QUANTIZE_KV=k_cache.dtype == E4M3, num_warps=2, **pdl)
    return query


@triton.jit
def _sigmoid_gate_kernel(attended_ptr, qkv_ptr, out_ptr, num_entries, qkv_row_stride,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = index < num_entries
    token = index // (NUM_HEADS * HEAD_DIM)
    head = (index // HEAD_DIM) % NUM_HEADS
    dim = index % HEAD_DIM
    attended = tl.load(attended_ptr + index, mask=mask, other=0.0)
    gate = tl.load(qkv_ptr + token * qkv_row_stride + head * 2 * HEAD_DIM + HEAD_DIM + dim,
                   mask=mask, other=0.0)
    dtype = attended.dtype
    # torch.sigmoid rounds to the activations' dtype before the product
    sigmoid = tl.sigmoid(gate.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + index, (attended.to(tl.float32) * sigmoid).to(dtype), mask=mask)


def sigmoid_gate(attended: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """``attended`` [tokens, heads, head_dim] times the sigmoid of each head's gate
    values in the fused projection ``qkv`` -> [tokens, heads * head_dim]."""
    num_tokens, num_heads, head_dim = attended.shape
    assert attended.is_contiguous() and qkv.stride(1) == 1
    out = torch.empty((num_tokens, num_heads * head_dim), dtype=attended.dtype,
                      device=attended.device)
    num_entries = out.numel()
    if num_entries:
        pdl = pdl_launch(qkv.device)
        _sigmoid_gate_kernel[(triton.cdiv(num_entries, GATE_BLOCK),)](
            attended, qkv, out, num_entries, qkv.stride(0), NUM_HEADS=num_heads,
            HEAD_DIM=head_dim, BLOCK=GATE_BLOCK, **pdl)
    return out
