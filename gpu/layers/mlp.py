"""The SwiGLU feed-forward block of a dense decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.layers.fp8_linear import takes_fp8_rows
from trio_llm.gpu.layers.fused_ops import FusedOps
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.quantization import Fp8Activation
from trio_llm.gpu.tensor_parallel import TensorParallel


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: the first half of the last dimension gates the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(hidden: torch.Tensor, gate_up_proj: Linear) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection of ``hidden``."""
    return silu_and_mul(gate_up_proj(hidden))


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection; under tensor parallelism a
    slice of the intermediate size, the down projection's partial sums reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool,
                 dtype: torch.dtype, device: torch.device, parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        local_size = parallel.split(intermediate_size, "the intermediate size")[1]
        self.gate_up_proj = Linear(hidden_size, 2 * local_size, bias=bias, dtype=dtype,
                                   device=device)
        self.down_proj = Linear(local_size, hidden_size, bias=bias, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.reduce(self.down_proj(gate_up_silu(hidden, self.gate_up_proj)))

    def fused(self, hidden: torch.Tensor | Fp8Activation, ops: FusedOps) -> torch.Tensor:
        """``forward`` with the activation through ``ops``' kernel (``hidden`` already in
        e4m3 where ``gate_up_proj`` is a per-channel FP8 layer: decoder.py), in e4m3
        straight from it where ``down_proj`` is one that quantizes this many rows."""
        quantize = takes_fp8_rows(self.down_proj, hidden.shape[0])
        return self.parallel.reduce(self.down_proj(
            ops.gate_up_silu(hidden, self.gate_up_proj, quantize=quantize)))
