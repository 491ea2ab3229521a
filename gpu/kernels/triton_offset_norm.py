"""RMSNorm of the ``(1 + weight)`` form (Qwen3.5, Qwen3-Next), fused with the residual add.

gpu/layers/norm.py's ``OffsetRMSNorm`` is the reference: the checkpoint stores the
weight's offset from one, the scale is applied in float32 and the result rounded
once (Qwen3's RMSNorm rounds the normed value before the weight). One kernel,
gpu/kernels/triton_layers.py's RMSNorm, computes both forms.
"""

from __future__ import annotations

import torch

from trio_llm.gpu.kernels.triton_layers import rms_norm_rows


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(1 + weight)``-RMSNorm over the last dimension of a 2-D ``x``."""
    return rms_norm_rows(x, None, weight, eps, offset=True)[0]


def add_offset_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)``, the sum rounded to the activation dtype."""
    return rms_norm_rows(x, residual, weight, eps, offset=True)
