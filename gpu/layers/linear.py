"""Linear layers, batch-invariant on request.

Batch invariance: on the CPU, ``F.linear(x[:n], W)`` is not bitwise equal to
``F.linear(x, W)[:n]``: the GEMM kernel picks its blocking from the number of
rows. A ``Linear`` with ``num_rows_per_chunk`` set multiplies fixed-size row
chunks (the last one zero-padded) instead, so a row's result never depends on
how many other rows share the batch. RMSNorm and RoPE work row by row and
element by element already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows per GEMM in batch-invariant mode.
INVARIANT_ROWS_PER_CHUNK = 32


class Linear(nn.Module):
    """``y = x W^T + b``; a fused layer holds several projections stacked along the output."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        # 0: one plain GEMM; otherwise fixed-size row chunks (batch-invariant).
        self.num_rows_per_chunk = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.num_rows_per_chunk:
            return chunked_linear(x, self.weight, self.bias, self.num_rows_per_chunk)
        return F.linear(x, self.weight, self.bias)


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   num_rows_per_chunk: int) -> torch.Tensor:
    """``F.linear`` over fixed-size chunks of rows: every GEMM has the same shape.

    The chunks go to one batched GEMM (the weight broadcast to every chunk): every
    chunk is still a GEMM of the same shape, without a Python loop over chunks and the
    concatenation after it (benchmarks/cpu_attention_bench.py times both).
    """
    num_rows, num_features = x.shape
    if weight.shape[0] == 1:
        # A one-column batched GEMM takes another path whose bits depend on the number
        # of chunks (measured on torch 2.13's CPU build): multiply a zero row too.
        padded = torch.cat([weight, weight.new_zeros(1, num_features)])
        padded_bias = None if bias is None else torch.cat([bias, bias.new_zeros(1)])
        return chunked_linear(x, padded, padded_bias, num_rows_per_chunk)[:, :1]
    num_padding_rows = -num_rows % num_rows_per_chunk
    if num_padding_rows:
        x = torch.cat([x, x.new_zeros(num_padding_rows, num_features)])
    chunks = x.view(-1, num_rows_per_chunk, num_features)
    weights = weight.t().expand(chunks.shape[0], num_features, weight.shape[0])
    if bias is None:
        products = torch.bmm(chunks, weights)
    else:
        products = torch.baddbmm(bias, chunks, weights)
    return products.view(-1, weight.shape[0])[:num_rows]
