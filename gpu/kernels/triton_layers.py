"""Fused Triton kernels for the decoder's small operations (the CUDA path).

A decode step of a small model is bound by kernel launches, not bytes: plain
torch spends about fifty kernels per layer on norms, rotary embeddings and
activations. These kernels do the same arithmetic in three:

- ``add_rms_norm``: residual add and RMSNorm in one pass (also of the ``(1 + weight)``
  form, gpu/kernels/triton_offset_norm.py's);
- ``qk_norm_rope_write_kv``: Qwen3's q/k RMSNorm, the rotary embedding, and
  the store of keys and values into the paged cache, straight from the fused
  qkv projection's output (into an FP8 cache: divided by the layer's scales and
  saturated, as gpu/quantization.py's ``quantize_kv``);
- ``silu_and_mul``: SwiGLU.

Linear layers fed one or two rows (decode of one or two streams) run through
gpu/kernels/triton_gemv.py's ``gemv``, which streams the weights faster than cuBLAS does
at that size.

Each kernel rounds where the torch model rounds (to the activation dtype after
the norm, after the weight, after each rotary product), so the fused model
computes the same function up to the order of float32 sums.

gpu/models/cuda_fused.py hands them to a model's fused forward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trio_llm.gpu.kernels.pdl import pdl_launch, pdl_start
from trio_llm.gpu.quantization import E4M3, E4M3_MAX, Fp8Activation, KVScales

SILU_BLOCK = 1024
# silu_and_mul_fp8's chunk: a row wider than it takes two passes (the kernel's docstring).
# qwen3-8b's rows (12,288) fit in one, as measured on an H100 (docs/performance.md);
# benchmarks/swiglu_fp8_bench.py times narrower chunks beside it.
SILU_FP8_BLOCK = 16384


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                     x_row_stride, residual_row_stride, scale_ptr, HIDDEN: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr, QUANTIZE: tl.constexpr = False,
                     OFFSET: tl.constexpr = False):
    # the GEMV after the norm may launch now and fetch its weights (gpu/kernels/pdl.py)
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < HIDDEN
    x = tl.load(x_ptr + row * x_row_stride + columns, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + columns, mask=mask,
                           other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * HIDDEN + columns, x, mask=mask)
    x32 = x.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x32 * x32, 0) / HIDDEN + eps)
    if OFFSET:
        # the (1 + weight) form (OffsetRMSNorm): scaled in float32, rounded once
        gain = 1.0 + tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * HIDDEN + columns,
                 (x32 * inverse * gain).to(out_ptr.dtype.element_ty), mask=mask)
        return
    # Qwen3's RMSNorm rounds the normed value before the weight
    normed = (x32 * inverse).to(x.dtype)
    weight = tl.load(weight_ptr + columns, mask=mask, other=0.0)
    if QUANTIZE:
        # the norm's output as the model rounds it, then in e4m3 with the row's scale:
        # fp8_gemm.quantize_groups' arithmetic, without the round trip through memory
        out32 = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype).to(tl.float32)
        scale = _e4m3_scale(tl.max(tl.where(mask, tl.abs(out32), 0.0), 0))
        tl.store(scale_ptr + row, scale)
        out_ptrs = out_ptr + row * HIDDEN + columns
        tl.store(out_ptrs, _over_scale(out32, scale, out_ptrs), mask=mask)
    else:
        out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * HIDDEN + columns, out, mask=mask)


@triton.jit
def _e4m3_scale(amax):
    """A row's e4m3 scale from its largest magnitude (1 for a row of zeros). With
    _over_scale, fp8_gemm.quantize_groups' arithmetic without its round trip through
    memory."""
    return tl.where(amax > 0, tl.math.div_rn(amax, E4M3_LARGEST), 1.0)


@triton.jit
def _over_scale(x32, scale, out_ptrs):
    """Values over their row's scale, saturated, in ``out_ptrs``' dtype (e4m3)."""
    return tl.clamp(tl.math.div_rn(x32, scale), -E4M3_LARGEST, E4M3_LARGEST).to(
        out_ptrs.dtype.element_ty)


@triton.jit
def _silu_and_mul(gate, up):
    """SwiGLU rounded as the torch model rounds it: silu(gate) in the input's dtype,
    then the product (float32, to be rounded by the caller)."""
    gate32 = gate.to(tl.float32)
    activated = (gate32 * tl.sigmoid(gate32)).to(gate.dtype)
    return activated.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, row_stride, INTERMEDIATE: tl.constexpr,
                         BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * row_stride + columns, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * row_stride + INTERMEDIATE + columns, mask=mask, other=0.0)
    tl.store(out_ptr + row * INTERMEDIATE + columns,
             _silu_and_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(gate_up_ptr, out_ptr, scale_ptr, row_stride,
                             INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr):
    """One program a row: the row's SwiGLU, rounded to the input's dtype, in e4m3 with
    the row's scale. A row wider than BLOCK takes two passes of BLOCK-wide chunks (the
    largest magnitude, then the values over the scale; the second reads the row again,
    from L2), so that a program holds a chunk, not the row, in registers."""
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    row = tl.program_id(0).to(tl.int64)
    gate_up_row = gate_up_ptr + row * row_stride
    out_row = out_ptr + row * INTERMEDIATE
    if BLOCK >= INTERMEDIATE:
        out32 = _swiglu_chunk(gate_up_row, 0, INTERMEDIATE, BLOCK)
        scale = _e4m3_scale(tl.max(tl.abs(out32), 0))  # (past the row: silu(0) * 0)
        tl.store(scale_ptr + row, scale)
        _store_e4m3_chunk(out_row, 0, out32, scale, INTERMEDIATE, BLOCK)
    else:
        largest = tl.zeros([BLOCK], tl.float32)
        for first in range(0, INTERMEDIATE, BLOCK):
            largest = tl.maximum(largest, tl.abs(_swiglu_chunk(gate_up_row, first,
                                                               INTERMEDIATE, BLOCK)))
        scale = _e4m3_scale(tl.max(largest, 0))
        tl.store(scale_ptr + row, scale)
        for first in range(0, INTERMEDIATE, BLOCK):
            _store_e4m3_chunk(out_row, first, _swiglu_chunk(gate_up_row, first, INTERMEDIATE,
                                                            BLOCK), scale, INTERMEDIATE, BLOCK)


@triton.jit
def _store_e4m3_chunk(out_row, first, out32, scale, INTERMEDIATE: tl.constexpr,
                      BLOCK: tl.constexpr):
    columns = first + tl.arange(0, BLOCK)
    tl.store(out_row + columns, _over_scale(out32, scale, out_row),
             mask=columns < INTERMEDIATE)


@triton.jit
def _swiglu_chunk(gate_up_row, first, INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr):
    """Columns first .. first + BLOCK of a row's SwiGLU, as the model rounds it, in
    float32 (zeros past the row)."""
    columns = first + tl.arange(0, BLOCK)
    mask = columns < INTERMEDIATE
    gate = tl.load(gate_up_row + columns, mask=mask, other=0.0)
    up = tl.load(gate_up_row + INTERMEDIATE + columns, mask=mask, other=0.0)
    return _silu_and_mul(gate, up).to(gate.dtype).to(tl.float32)


@triton.jit
def _rms_norm_heads(first, second, weight_ptr, half_dims, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm of one head given as its two halves; rounds as the torch model does."""
    first32 = first.to(tl.float32)
    second32 = second.to(tl.float32)
    variance = (tl.sum(first32 * first32, 0) + tl.sum(second32 * second32, 0)) / HEAD_DIM
    inverse = tl.rsqrt(variance + eps)
    weight_first = tl.load(weight_ptr + half_dims).to(tl.float32)
    weight_second = tl.load(weight_ptr + HEAD_DIM // 2 + half_dims).to(tl.float32)
    first = (weight_first * (first32 * inverse).to(first.dtype).to(tl.float32)).to(first.dtype)
    second = (weight_second * (second32 * inverse).to(second.dtype).to(tl.float32)).to(
        second.dtype)
    return first, second


@triton.jit
def rotate_halves(first, second, cos, sin):
    """Rotate-half RoPE: (a, b) -> (a cos - b sin, b cos + a sin), rounding each product."""
    dtype = first.dtype
    first32 = first.to(tl.float32)
    second32 = second.to(tl.float32)
    new_first = ((first32 * cos).to(dtype).to(tl.float32)
                 + (-second32 * sin).to(dtype).to(tl.float32)).to(dtype)
    new_second = ((second32 * cos).to(dtype).to(tl.float32)
                  + (first32 * sin).to(dtype).to(tl.float32)).to(dtype)
    return new_first, new_second


E4M3_LARGEST: tl.constexpr = tl.constexpr(E4M3_MAX)


@triton.jit
def as_cached(x, scale, cache_ptr, QUANTIZE: tl.constexpr):
    """``x`` as a cache of ``cache_ptr``'s dtype stores it: an FP8 cache holds ``x / scale``,
    saturated at e4m3's largest value."""
    if QUANTIZE:
        x = tl.clamp(x.to(tl.float32) / scale, -E4M3_LARGEST, E4M3_LARGEST)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _qk_norm_rope_write_kv_kernel(
    qkv_ptr, positions_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, eps,
    query_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, qkv_row_stride, k_scale,
    v_scale, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_QK_NORM: tl.constexpr, QUANTIZE_KV: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)  # gpu/kernels/pdl.py
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half_dims = tl.arange(0, HEAD_DIM // 2)
    is_query = head < NUM_HEADS
    # Query heads come first in the fused projection, then key heads, then value heads.
    source = qkv_ptr + token * qkv_row_stride + head * HEAD_DIM
    first = tl.load(source + half_dims)
    second = tl.load(source + HEAD_DIM // 2 + half_dims)
    if HAS_QK_NORM:
        norm_ptr = k_norm_ptr
        if is_query:
            norm_ptr = q_norm_ptr
        first, second = _rms_norm_heads(first, second, norm_ptr, half_dims, eps, HEAD_DIM)
    position = tl.load(positions_ptr + token).to(tl.int64)
    # The table repeats its HEAD_DIM // 2 angles: both halves use the first.
    cos = tl.load(cos_ptr + position * HEAD_DIM + half_dims).to(first.dtype).to(tl.float32)
    sin = tl.load(sin_ptr + position * HEAD_DIM + half_dims).to(first.dtype).to(tl.float32)
    first, second = rotate_halves(first, second, cos, sin)
    if is_query:
        target = query_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(target + half_dims, first.to(query_out_ptr.dtype.element_ty))
        tl.store(target + HEAD_DIM // 2 + half_dims, second.to(query_out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            kv_head = head - NUM_HEADS
            offset = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + offset + half_dims,
                     as_cached(first, k_scale, k_cache_ptr, QUANTIZE_KV))
            tl.store(k_cache_ptr + offset + HEAD_DIM // 2 + half_dims,
                     as_cached(second, k_scale, k_cache_ptr, QUANTIZE_KV))
            value_source = source + NUM_KV_HEADS * HEAD_DIM
            dims = tl.arange(0, HEAD_DIM)
            tl.store(v_cache_ptr + offset + dims,
                     as_cached(tl.load(value_source + dims), v_scale, v_cache_ptr, QUANTIZE_KV))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a 2-D ``x``."""
    return rms_norm_rows(x, None, weight, eps, offset=False)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, the sum rounded to the activation dtype."""
    return rms_norm_rows(x, residual, weight, eps, offset=False)


def rms_norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                  eps: float, *, offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, or ``(norm(x), x)`` without ``residual``;
    ``offset``: the ``(1 + weight)`` form, scaled in float32 and rounded once, instead of
    Qwen3's (the normed value rounded before the weight)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        _launch_rms_norm(x, None, weight, eps, out, None, offset=offset)
        return out, x
    new_residual = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, new_residual, offset=offset)
    return out, new_residual


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[Fp8Activation, torch.Tensor]:
    """``rms_norm`` (``residual`` None) or ``add_rms_norm``, the normed rows handed on in
    e4m3 with one scale per row, as an FP8 GEMM quantizes its input (the per-channel
    Fp8Linear's), and the residual stream (``x`` itself without ``residual``)."""
    num_rows, hidden = x.shape
    values = torch.empty((num_rows, hidden), dtype=E4M3, device=x.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    new_residual = x
    if residual is not None:
        new_residual = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch_rms_norm(x, residual, weight, eps, values, new_residual if residual is not None
                     else None, scales)
    return Fp8Activation(values, scales, x.dtype), new_residual


def _launch_rms_norm(x, residual, weight, eps, out, new_residual, scales=None, offset=False):
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    pdl = pdl_launch(x.device)
    _rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out,
        new_residual if new_residual is not None else out, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0,
        scales if scales is not None else out, QUANTIZE=scales is not None,
        HIDDEN=hidden, HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        OFFSET=offset, num_warps=4 if hidden <= 2048 else 8,
        **pdl,
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of [num_rows, 2 * intermediate] -> [num_rows, intermediate]."""
    num_rows, width = gate_up.shape
    intermediate = width // 2
    out = torch.empty((num_rows, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows:
        assert gate_up.stride(1) == 1
        block = min(SILU_BLOCK, triton.next_power_of_2(intermediate))
        pdl = pdl_launch(gate_up.device)
        _silu_and_mul_kernel[(num_rows, triton.cdiv(intermediate, block))](
            gate_up, out, gate_up.stride(0), INTERMEDIATE=intermediate, BLOCK=block,
            **pdl)
    return out


def silu_fp8_launch(intermediate: int) -> tuple[int, int]:
    """(BLOCK, warps) of ``silu_and_mul_fp8``'s kernel for a row of ``intermediate``."""
    block = min(SILU_FP8_BLOCK, triton.next_power_of_2(intermediate))
    return block, min(16, max(4, block // 512))


def silu_and_mul_fp8(gate_up: torch.Tensor) -> Fp8Activation:
    """``silu_and_mul`` handed on in e4m3 with one scale per row, as an FP8 GEMM
    quantizes its input (the per-channel Fp8Linear's): one kernel and one round trip
    through memory fewer than the SwiGLU then ``fp8_gemm.quantize_groups``, the same
    bits."""
    num_rows, width = gate_up.shape
    intermediate = width // 2
    values = torch.empty((num_rows, intermediate), dtype=E4M3, device=gate_up.device)
    scales = torch.empty((num_rows, 1), dtype=torch.float32, device=gate_up.device)
    if num_rows:
        assert gate_up.stride(1) == 1
        block, num_warps = silu_fp8_launch(intermediate)
        pdl = pdl_launch(gate_up.device)
        _silu_and_mul_fp8_kernel[(num_rows,)](
            gate_up, values, scales, gate_up.stride(0), INTERMEDIATE=intermediate,
            BLOCK=block, num_warps=num_warps, **pdl)
    return Fp8Activation(values, scales, gate_up.dtype)


def qk_norm_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, q_norm: torch.Tensor | None,
                          k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          num_heads: int, num_kv_heads: int, head_dim: int,
                          kv_scales: KVScales | None = None) -> torch.Tensor:
    """From the fused qkv output [num_tokens, (heads + 2 kv_heads) * head_dim]: normed,
    rotated queries [num_tokens, num_heads, head_dim]; keys and values go to the cache
    (an FP8 cache: divided by ``kv_scales``)."""
    kv_scales = kv_scales or KVScales()
    num_tokens = qkv.shape[0]
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    assert qkv.stride(1) == 1 and cos.is_contiguous() and k_cache.is_contiguous()
    assert head_dim % 2 == 0 and triton.next_power_of_2(head_dim) == head_dim
    has_qk_norm = q_norm is not None and k_norm is not None
    pdl = pdl_launch(qkv.device)
    _qk_norm_rope_write_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q_norm if has_qk_norm else cos,
        k_norm if has_qk_norm else cos, eps, query, k_cache, v_cache, slot_mapping,
        qkv.stride(0), kv_scales.k_scale, kv_scales.v_scale, NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HAS_QK_NORM=has_qk_norm,
        QUANTIZE_KV=k_cache.dtype == E4M3, num_warps=1,
        **pdl,
    )
    return query


