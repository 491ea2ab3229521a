"""RMSNorm of the ``(1 + weight)`` form (Qwen3.5, Qwen3-Next), fused with the residual add.

gpu/layers/norm.py's ``OffsetRMSNorm`` is the reference: the checkpoint stores the
weight's offset from one, the scale is applied in float32 and the result rounded
once (Qwen3's RMSNorm rounds the normed value before the weight; the triton_layers
kernel does that, so these layers get their own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _offset_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
                            x_row_stride, residual_row_stride, HIDDEN: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    scale = 1.0 + tl.load(weight_ptr + columns, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + columns,
             (x32 * inverse * scale).to(out_ptr.dtype.element_ty), mask=mask)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight)``-RMSNorm over the last dimension of a 2-D ``x``."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def add_offset_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, the sum rounded to the activation dtype."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, new_residual: torch.Tensor | None) -> None:
    num_rows, hidden = x.shape
    if num_rows == 0:
        return
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    _offset_rms_norm_kernel[(num_rows,)](
        x, residual if residual is not None else x, weight, out,
        new_residual if new_residual is not None else out, eps, x.stride(0),
        residual.stride(0) if residual is not None else 0, HIDDEN=hidden,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
        num_warps=4 if hidden <= 2048 else 8)
