"""Grouped-query self-attention over the paged KV cache (fused QKV, optional q/k norms).

The attention arithmetic itself is an AttentionBackend's (gpu/attention.py: the
torch reference; gpu/kernels/: Triton and numba); this layer projects, norms,
rotates, stores keys and values, and projects back. Under tensor parallelism it
holds its rank's heads and ``o_proj``'s partial sums are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trio_llm.gpu.attention import AttentionBackend
from trio_llm.gpu.layers.exact import batch_invariant
from trio_llm.gpu.layers.fused_ops import FusedOps
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.layers.norm import OffsetRMSNorm, RMSNorm
from trio_llm.gpu.layers.rotary import RotaryEmbedding
from trio_llm.gpu.quantization import Fp8Activation, KVScales
from trio_llm.gpu.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from trio_llm.gpu.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache (tensors on the model's device).

    ``slot_mapping`` [num_tokens]; ``block_tables`` [num_seqs, max_blocks_per_seq];
    ``context_lens`` [num_seqs] (this step's tokens included); ``query_start_loc``
    [num_seqs + 1]: the layout gpu/attention.py documents.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    # Models with linear-attention layers (gpu/layers/linear_attention.py): each
    # sequence's slot in the state caches, and whether it continues from the state
    # there (False: it starts from zeros). None for other models.
    state_slots: list[int] | None = None
    continues_state: list[bool] | None = None


class Attention(nn.Module):
    """Grouped-query self-attention with fused QKV, optional q/k norms (Qwen3) and biases,
    and optionally (Qwen3.5, Qwen3-Next) a sigmoid output gate: q_proj then gives each
    head its queries followed by as many gate values, and the attention output is
    multiplied by the gate's sigmoid before o_proj."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_heads = parallel.split(config.num_heads, "the number of attention heads")[1]
        self.num_kv_heads = parallel.split(config.num_kv_heads, "the number of KV heads")[1]
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.has_output_gate = config.attention_output_gate
        self.q_rows = 2 * self.q_size if self.has_output_gate else self.q_size
        # what an FP8 KV cache divides keys and values by (the loader sets the
        # checkpoint's); a cache in the model's dtype keeps 1.0
        self.kv_scales = KVScales()
        self.qkv_proj = Linear(config.hidden_size, self.q_rows + 2 * self.kv_size,
                               bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias,
                             dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            norm = OffsetRMSNorm if config.offset_norms else RMSNorm
            self.q_norm = norm(config.head_dim, eps=config.rms_norm_eps, dtype=dtype,
                               device=device)
            self.k_norm = norm(config.head_dim, eps=config.rms_norm_eps, dtype=dtype,
                               device=device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: KVCache, metadata: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(
            [self.q_rows, self.kv_size, self.kv_size], dim=-1)
        gate = None
        if self.has_output_gate:
            query, gate = query.reshape(num_tokens, self.num_heads, 2 * self.head_dim).split(
                self.head_dim, dim=-1)
            gate = gate.reshape(num_tokens, self.q_size)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotary(positions, query, key)
        k_cache, v_cache = kv_cache
        scales = {"k_scale": self.kv_scales.k_scale, "v_scale": self.kv_scales.v_scale}
        backend.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping, **scales)
        attended = backend.paged_attention(query, k_cache, v_cache, metadata.block_tables,
                                           metadata.context_lens, metadata.query_start_loc,
                                           self.scale, **scales)
        attended = attended.reshape(num_tokens, self.q_size)
        if gate is not None:
            attended = attended * batch_invariant(torch.sigmoid, gate)
        return self.parallel.reduce(self.o_proj(attended))

    def fused(self, hidden: torch.Tensor | Fp8Activation, positions: torch.Tensor,
              rotary: RotaryEmbedding,
              kv_cache: KVCache, step: Any, backend: AttentionBackend,
              ops: FusedOps) -> torch.Tensor:
        """``forward`` with the q/k norms, rotation and cache store in one kernel."""
        k_cache, v_cache = kv_cache
        q_norm, k_norm = self.q_norm, self.k_norm
        query = ops.qk_norm_rope_write_kv(
            self.qkv_proj(hidden), positions, rotary.cos, rotary.sin,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0, k_cache, v_cache, step.slot_mapping,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            kv_scales=self.kv_scales)
        attended = ops.attend(query, k_cache, v_cache, step, self.scale, backend,
                              self.kv_scales)
        return self.parallel.reduce(self.o_proj(attended.view(hidden.shape[0], self.q_size)))
