"""The model's building blocks: linear layers, RMSNorm, rotary embeddings.

Batch invariance: on the CPU, ``F.linear(x[:n], W)`` is not bitwise equal to
``F.linear(x, W)[:n]``: the GEMM kernel picks its blocking from the number of
rows. A ``Linear`` with ``num_rows_per_chunk`` set multiplies fixed-size row
chunks (the last one zero-padded) instead, so a row's result never depends on
how many other rows share the batch. RMSNorm and RoPE work row by row and
element by element already.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.config import RopeConfig

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


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: the first half of the last dimension gates the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout, with a cos/sin table for every position."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, *,
                 device: torch.device) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope).to(device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @property
    def max_positions(self) -> int:
        return int(self.cos.shape[0])

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query``/``key`` [num_tokens, num_heads, head_dim] to their positions."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """The rotation speed of each of the ``head_dim / 2`` pairs, llama3-scaled if asked."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1's long-context scaling: slow (long-wavelength) frequencies are divided
    by ``factor``, fast ones kept, and those in between interpolated smoothly."""
    old_context = rope.original_max_position_embeddings
    low_freq_wavelength = old_context / rope.low_freq_factor
    high_freq_wavelength = old_context / rope.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / rope.factor, inv_freq)
    smooth = ((old_context / wavelength - rope.low_freq_factor)
              / (rope.high_freq_factor - rope.low_freq_factor))
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(is_medium, smoothed, scaled)
