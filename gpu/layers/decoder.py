"""One decoder layer: a pre-norm token mixer, then a pre-norm feed-forward block.

The token mixer is attention over the KV cache (layers/attention.py, ``self_attn``)
unless the family gives the layer another one: Gated DeltaNet linear attention
(layers/linear_attention.py, ``linear_attn``), which reads and writes a state
cache instead of the KV cache. The feed-forward block is the family's: a dense
MLP (layers/mlp.py) or a Mixture-of-Experts block (layers/moe.py); anything with
``forward(hidden)`` and ``fused(hidden, ops)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from trio_llm.gpu.attention import AttentionBackend
from trio_llm.gpu.layers.attention import Attention, AttentionMetadata, KVCache
from trio_llm.gpu.layers.fp8_linear import takes_fp8_rows
from trio_llm.gpu.layers.fused_ops import FusedOps
from trio_llm.gpu.layers.linear_attention import GatedDeltaNet, StateCache
from trio_llm.gpu.layers.norm import OffsetRMSNorm, RMSNorm
from trio_llm.gpu.layers.rotary import RotaryEmbedding
from trio_llm.gpu.quantization import Fp8Activation
from trio_llm.gpu.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from trio_llm.gpu.models.config import ModelConfig


class FeedForward(Protocol):
    """A decoder layer's feed-forward block."""

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def fused(self, hidden: torch.Tensor | Fp8Activation, ops: FusedOps) -> torch.Tensor:
        """(An Fp8Activation only for a block whose ``gate_up_proj`` takes one.)"""
        ...


class DecoderLayer(nn.Module):
    """The pre-norm token mixer then the pre-norm feed-forward, each added to the
    residual. ``linear_attn``: the layer's Gated DeltaNet, if it mixes by linear
    attention (its ``cache`` is then a StateCache, not a KVCache)."""

    # an attention layer's token mixer (absent from a linear-attention layer)
    self_attn: Attention

    def __init__(self, config: ModelConfig, feed_forward: nn.Module, *, dtype: torch.dtype,
                 device: torch.device, parallel: TensorParallel,
                 linear_attn: GatedDeltaNet | None = None) -> None:
        super().__init__()
        norm = OffsetRMSNorm if config.offset_norms else RMSNorm
        self.input_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps,
                                    dtype=dtype, device=device)
        self.linear_attn = linear_attn
        if linear_attn is None:
            self.self_attn = Attention(config, dtype=dtype, device=device, parallel=parallel)
        self.post_attention_layernorm = norm(config.hidden_size, eps=config.rms_norm_eps,
                                             dtype=dtype, device=device)
        self.mlp = feed_forward

    @property
    def token_mixer(self) -> nn.Module:
        return self.linear_attn if self.linear_attn is not None else self.self_attn

    @property
    def feed_forward(self) -> FeedForward:
        return self.mlp  # type: ignore[return-value]  # a Module with fused()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: KVCache | StateCache, metadata: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.token_mixer(self.input_layernorm(hidden), positions, rotary,
                                           kv_cache, metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def fused(self, hidden: torch.Tensor, residual: torch.Tensor | None,
              positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: KVCache, step: Any,
              backend: AttentionBackend, ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with each residual add fused into the next norm: takes and returns
        (this block's output, the residual stream before it is added); ``residual`` None
        at the first layer, whose input is the embedding."""
        assert self.linear_attn is None, "a linear-attention layer has no fused form yet"
        normed, residual = _fused_norm(ops, hidden, residual, self.input_layernorm,
                                       self.self_attn.qkv_proj)
        hidden = self.self_attn.fused(normed, positions, rotary, kv_cache, step, backend, ops)
        normed, residual = _fused_norm(ops, hidden, residual, self.post_attention_layernorm,
                                       getattr(self.mlp, "gate_up_proj", None))
        return self.feed_forward.fused(normed, ops), residual


def _fused_norm(ops: FusedOps, hidden: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm, consumer: nn.Module | None
                ) -> tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
    """(the norm of ``hidden`` (plus ``residual``), the residual stream); in e4m3 straight
    from the norm's kernel where ``consumer``, the layer it feeds, is a per-channel FP8
    layer that quantizes this many rows (it would quantize them per token itself: one
    kernel and one round trip through memory fewer). A decode step's few rows stay
    unrounded: the FP8 GEMV takes them as they are."""
    if takes_fp8_rows(consumer, hidden.shape[0]):
        return ops.rms_norm_fp8(hidden, residual, norm.weight, norm.eps)
    if residual is None:
        return ops.rms_norm(hidden, norm.weight, norm.eps), hidden
    return ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
