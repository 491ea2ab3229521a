"""The hybrid family's forward on CUDA (Qwen3.5, Qwen3-Next): Gated DeltaNet layers and
gated full attention through Triton kernels and fla-core, inside CUDA graphs.

gpu/models/cuda_fused.py's FusedHybridLM runs a model with linear-attention layers
(or gated attention, or ``(1 + weight)`` norms) through ``hybrid_forward``, layer
by layer over the same modules and weights as the torch forward (the layers'
``forward`` is the reference each kernel is tested against):

- the norms of the ``(1 + weight)`` form with the residual add fused
  (gpu/kernels/triton_offset_norm.py);
- a linear-attention layer: its projections (``GatedDeltaNet.project``), the
  causal conv1d and the gated delta rule with each sequence's state in its slot
  (gpu/kernels/triton_linear_attention.py; a step of one token per sequence updates
  the states in place; any other step updates its one-token sequences in place too
  and runs its longer ones, at most ``MAX_CHUNKED_SEQS``, through fla-core's chunked
  kernel, gpu/kernels/fla_gated_delta_rule.py), the gated RMSNorm, out_proj;
- a full-attention layer: q/k norm, partial rotary and the KV store in one kernel,
  the paged attention, the sigmoid output gate (gpu/kernels/triton_gated_attention.py);
- the feed-forward block's own fused form (MLP or MoE with its shared expert).

The step's layout comes as a ``CudaStepMetadata``: the attention metadata plus each
sequence's state slot on the device (-1 for a padding sequence) and whether the step
has one token per sequence. Nothing reads a value on the host, so every step kind
is captured in a graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trio_llm.actors.config import MAX_CHUNKED_SEQS
from trio_llm.gpu.kernels import triton_gated_attention, triton_linear_attention
from trio_llm.gpu.kernels.triton_offset_norm import add_offset_rms_norm, offset_rms_norm
from trio_llm.gpu.layers.attention import Attention, AttentionMetadata
from trio_llm.gpu.layers.fused_ops import FusedOps
from trio_llm.gpu.layers.linear_attention import GatedDeltaNet, StateCache
from trio_llm.gpu.layers.norm import OffsetRMSNorm, RMSNorm
from trio_llm.gpu.layers.rotary import RotaryEmbedding
from trio_llm.gpu.models.base import CausalLM, LayerCache


@dataclass(slots=True)
class CudaStepMetadata(AttentionMetadata):
    """AttentionMetadata with what the hybrid layers read on the device:
    ``state_slot_ids`` [num_seqs] (int64; -1 for a padding sequence), and
    ``is_decode``: every sequence has exactly one token (a decode step or graph; the
    token count alone cannot say it, a varlen graph may have as many sequence slots
    as tokens)."""

    state_slot_ids: torch.Tensor | None = None
    is_decode: bool = False


def is_hybrid(model: CausalLM) -> bool:
    """Whether ``model`` runs through ``hybrid_forward`` rather than the dense fused one."""
    config = model.config
    return bool(model.num_linear_attention_layers or config.attention_output_gate
                or config.offset_norms or config.rotary_dim != config.head_dim)


def hybrid_forward(model: CausalLM, ops: FusedOps, token_ids: torch.Tensor,
                   positions: torch.Tensor, caches: list[LayerCache],
                   metadata: AttentionMetadata) -> torch.Tensor:
    """Hidden states after the final norm, one row per input token (CausalLM.forward's
    contract), through the kernels; ``ops`` the dense kernel set (feed-forward blocks)."""
    hidden = model.embed(token_ids)
    residual: torch.Tensor | None = None
    for layer, cache in zip(model.decoder_layers, caches, strict=True):
        normed, residual = _norm(layer.input_layernorm, hidden, residual, ops)
        if layer.linear_attn is not None:
            assert isinstance(cache, StateCache)
            hidden = linear_attention(layer.linear_attn, normed, cache, metadata)
        else:
            assert not isinstance(cache, StateCache)
            hidden = gated_attention(layer.self_attn, normed, positions, model.rotary, cache,
                                     metadata, model.attention_backend, ops)
        normed, residual = _norm(layer.post_attention_layernorm, hidden, residual, ops)
        hidden = layer.feed_forward.fused(normed, ops)
    return _norm(model.norm, hidden, residual, ops)[0]


def _norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None,
          ops: FusedOps) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(hidden + residual), hidden + residual); the first layer's residual is its
    input."""
    if isinstance(norm, OffsetRMSNorm):
        if residual is None:
            return offset_rms_norm(hidden, norm.weight, norm.eps), hidden
        return add_offset_rms_norm(hidden, residual, norm.weight, norm.eps)
    if residual is None:
        return ops.rms_norm(hidden, norm.weight, norm.eps), hidden
    return ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)


def linear_attention(layer: GatedDeltaNet, hidden: torch.Tensor, cache: StateCache,
                     metadata: AttentionMetadata) -> torch.Tensor:
    """GatedDeltaNet.forward through the kernels; each sequence's states in its slot."""
    slots = getattr(metadata, "state_slot_ids", None)
    if slots is None:
        raise ValueError("a linear-attention layer on CUDA needs the step's state slots "
                         "on the device (CudaStepMetadata.state_slot_ids)")
    shape = layer.shape
    num_tokens = hidden.shape[0]
    mixed, z, b, a = layer.project(hidden)
    weight = layer.conv_weight[:, 0]
    context_lens, query_start_loc = metadata.context_lens, metadata.query_start_loc
    scale = shape.key_head_dim ** -0.5
    if getattr(metadata, "is_decode", False):
        convolved = triton_linear_attention.causal_conv1d_decode(
            mixed, weight, None, cache.conv, context_lens, slots)
        query, key, value = _heads(convolved, layer)
        attended = triton_linear_attention.gated_delta_rule_decode(
            query, key, value, a, b, layer.A_log, layer.dt_bias, cache.recurrent, context_lens,
            slots, scale)
    else:
        from trio_llm.gpu.kernels.fla_gated_delta_rule import mixed_gated_delta_rule

        # the conv reads and writes every sequence's state in its slot already
        convolved = triton_linear_attention.causal_conv1d_varlen(
            mixed, weight, None, cache.conv, query_start_loc, context_lens, slots)
        query, key, value = _heads(convolved, layer)
        attended = mixed_gated_delta_rule(
            query, key, value, a, b, layer.A_log, layer.dt_bias, cache.recurrent,
            query_start_loc, context_lens, slots, scale, MAX_CHUNKED_SEQS)
    normed = triton_linear_attention.gated_rms_norm(
        attended, z.unflatten(-1, (shape.num_value_heads, shape.value_head_dim)),
        layer.norm.weight, layer.norm.eps)
    return layer.parallel.reduce(layer.out_proj(normed.view(num_tokens, shape.value_size)))


def _heads(convolved: torch.Tensor, layer: GatedDeltaNet
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the conv's output [tokens, channels] as queries, keys [tokens, key heads,
    key dim] and values [tokens, value heads, value dim]."""
    shape = layer.shape
    query, key, value = convolved.split([shape.key_size, shape.key_size, shape.value_size],
                                        dim=-1)
    return (query.unflatten(-1, (shape.num_key_heads, shape.key_head_dim)),
            key.unflatten(-1, (shape.num_key_heads, shape.key_head_dim)),
            value.unflatten(-1, (shape.num_value_heads, shape.value_head_dim)))


def gated_attention(attention: Attention, hidden: torch.Tensor, positions: torch.Tensor,
                    rotary: RotaryEmbedding, kv_cache: Any, metadata: AttentionMetadata,
                    backend: Any, ops: FusedOps) -> torch.Tensor:
    """Attention.forward of the hybrid family (output gate, ``(1 + weight)`` q/k norms,
    partial rotary) through the kernels."""
    assert attention.has_output_gate and isinstance(attention.q_norm, OffsetRMSNorm) \
        and isinstance(attention.k_norm, OffsetRMSNorm), "the hybrid family's attention"
    k_cache, v_cache = kv_cache
    qkv = attention.qkv_proj(hidden)
    query = triton_gated_attention.gated_qk_norm_rope_write_kv(
        qkv, positions, rotary.cos, rotary.sin, attention.q_norm.weight,
        attention.k_norm.weight, attention.q_norm.eps, k_cache, v_cache,
        metadata.slot_mapping, num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads, head_dim=attention.head_dim,
        kv_scales=attention.kv_scales)
    attended = ops.attend(query, k_cache, v_cache, metadata, attention.scale, backend,
                          attention.kv_scales)
    gated = triton_gated_attention.sigmoid_gate(attended.contiguous(), qkv)
    return attention.parallel.reduce(attention.o_proj(gated))
