"""RMSNorm, computed in float32 row by row (batch-invariant as it stands)."""

from __future__ import annotations

import torch
from torch import nn

from trio_llm.gpu.layers.exact import batch_invariant, sum_of_squares


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32."""

    def __init__(self, size: int, *, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        normed = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * normed.to(input_dtype)


class OffsetRMSNorm(RMSNorm):
    """RMSNorm of the ``(1 + weight)`` form (Qwen3.5, Qwen3-Next): the checkpoint stores
    the weight's offset from one. As transformers computes it, the scale is applied in
    float32 and rounded once at the end. Its variance is summed batch-invariantly
    (layers/exact.py): the family's torch path is the CPU's only one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        normed = x32 * torch.rsqrt(sum_of_squares(x32, mean=True) + self.eps)
        return (normed * (1.0 + self.weight.to(torch.float32))).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension, then multiplied by ``silu(gate)``: the
    output norm of a Gated DeltaNet layer (norm before gate, as transformers computes)."""
    x32 = x.to(torch.float32)
    normed = weight * (x32 * torch.rsqrt(sum_of_squares(x32, mean=True) + eps)).to(x.dtype)
    gate = batch_invariant(torch.nn.functional.silu, gate.to(torch.float32))
    return (normed * gate).to(x.dtype)
