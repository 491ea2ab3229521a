"""Rotary position embeddings (RoPE): the default and Llama 3.1's scaled frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base ``theta``, and the llama3 frequency scaling if any."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half layout, with a cos/sin table for every position.

    ``rotary_dim`` < head_dim (partial rotary, Qwen3.5 and Qwen3-Next): only each head's
    first ``rotary_dim`` entries rotate, at the frequencies of a ``rotary_dim``-wide head;
    the rest pass through."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, *,
                 device: torch.device, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.is_partial = self.rotary_dim != head_dim
        inv_freq = rope_inverse_frequencies(self.rotary_dim, rope).to(device)
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
        if self.is_partial:
            return _rotate_part(query, cos, sin), _rotate_part(key, cos, sin)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return x * cos + rotated_half * sin


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` entries of each head; the rest pass through."""
    rotary_dim = cos.shape[-1]
    return torch.cat([_rotate(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


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
