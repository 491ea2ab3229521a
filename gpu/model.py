"""The Llama / Qwen2 / Qwen3 dense decoder over a flattened varlen batch.

One forward takes the tokens of every scheduled request concatenated: prefill
chunks and single decode tokens side by side. Each layer writes its keys and
values into the paged cache first, then attends through the block tables, so a
chunk sees the earlier chunks of its prompt and its own tokens alike.

Projections are fused at load time: q/k/v into one ``qkv_proj``, gate/up into
one ``gate_up_proj`` (see gpu/loader.py for the name mapping).

Under tensor parallelism (gpu/tensor_parallel.py) each module holds its rank's
shard: its heads, its slice of the intermediate size and of the vocabulary; the
row-parallel ``o_proj`` and ``down_proj`` outputs are summed over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.attention import AttentionBackend, default_attention_backend
from trio_llm.gpu.config import ModelConfig
from trio_llm.gpu.layers import (
    INVARIANT_ROWS_PER_CHUNK,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    silu_and_mul,
)
from trio_llm.gpu.tensor_parallel import TensorParallel

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


class Attention(nn.Module):
    """Grouped-query self-attention with fused QKV, optional q/k norms (Qwen3) and biases."""

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
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias,
                             dtype=dtype, device=device)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps, dtype=dtype,
                                  device=device)
            self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps, dtype=dtype,
                                  device=device)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: KVCache, metadata: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv_proj(hidden).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotary(positions, query, key)
        k_cache, v_cache = kv_cache
        backend.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        attended = backend.paged_attention(query, k_cache, v_cache, metadata.block_tables,
                                           metadata.context_lens, metadata.query_start_loc,
                                           self.scale)
        return self.parallel.reduce(self.o_proj(attended.reshape(num_tokens, self.q_size)))


class MLP(nn.Module):
    """SwiGLU feed-forward with fused gate/up projection."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel) -> None:
        super().__init__()
        self.parallel = parallel
        intermediate_size = parallel.split(config.intermediate_size, "the intermediate size")[1]
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size,
                                   bias=config.mlp_bias, dtype=dtype, device=device)
        self.down_proj = Linear(intermediate_size, config.hidden_size,
                                bias=config.mlp_bias, dtype=dtype, device=device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.parallel.reduce(self.down_proj(silu_and_mul(self.gate_up_proj(hidden))))


class DecoderLayer(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 parallel: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                       dtype=dtype, device=device)
        self.self_attn = Attention(config, dtype=dtype, device=device, parallel=parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                                dtype=dtype, device=device)
        self.mlp = MLP(config, dtype=dtype, device=device, parallel=parallel)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: KVCache, metadata: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, rotary,
                                         kv_cache, metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class CausalLM(nn.Module):
    """A decoder-only language model of one of the supported families.

    ``attention_backend`` is the hook for fast attention kernels: any
    AttentionBackend with the reference's signatures can replace it.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None,
                 parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = device
        self.parallel = parallel = parallel or TensorParallel.single()
        # This rank's slice of the vocabulary: [vocab_start, vocab_start + num_vocab_rows).
        self.vocab_start, self.num_vocab_rows = parallel.padded_split(config.vocab_size)
        self.embed_tokens = nn.Parameter(
            torch.empty(self.num_vocab_rows, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype=dtype, device=device,
                                                 parallel=parallel)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                            device=device)
        self.lm_head = Linear(config.hidden_size, self.num_vocab_rows, bias=False, dtype=dtype,
                              device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        self.rotary = RotaryEmbedding(config.head_dim,
                                      max_positions or config.max_position_embeddings,
                                      config.rope, device=device)
        self.attention_backend = default_attention_backend(device)
        self.set_batch_invariant(device.type == "cpu")

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every row's result independent of the batch it shares (the CPU default)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.num_rows_per_chunk = INVARIANT_ROWS_PER_CHUNK if enabled else 0

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token."""
        hidden = self.embed(token_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, self.rotary, kv_cache, metadata,
                           self.attention_backend)
        return self.norm(hidden)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embedding of each token id; with several ranks each looks up the ids in
        its slice of the vocabulary, zeros elsewhere, and the lookups are summed."""
        if not self.parallel.is_parallel:
            return F.embedding(token_ids, self.embed_tokens)
        local_ids = token_ids - self.vocab_start
        is_local = (local_ids >= 0) & (local_ids < self.num_vocab_rows)
        rows = F.embedding(local_ids.clamp(0, self.num_vocab_rows - 1), self.embed_tokens)
        return self.parallel.sum_exact(torch.where(is_local.unsqueeze(-1), rows, 0.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [num_rows, vocab_size] for the given rows of hidden states."""
        logits = self.parallel.gather_columns(self.lm_head(hidden))
        if logits.shape[-1] != self.config.vocab_size:  # the last slice's padding rows
            logits = logits[:, :self.config.vocab_size].contiguous()
        return logits.to(torch.float32)

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads whose cache this rank holds."""
        return self.config.num_kv_heads // self.parallel.world_size

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take in the caches of all layers (on this
        rank: its KV heads only)."""
        config = self.config
        return 2 * config.num_layers * self.num_local_kv_heads * config.head_dim \
            * self.dtype.itemsize

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        """One (key, value) cache pair per layer, each
        [num_blocks, block_size, kv_heads (this rank's), head_dim]."""
        shape = (num_blocks, block_size, self.num_local_kv_heads, self.config.head_dim)
        # Slots are always written before they are read, so the CPU skips zeroing
        # (and committing) memory it may never touch.
        allocate = torch.zeros if self.device.type != "cpu" else torch.empty
        return [(allocate(shape, dtype=self.dtype, device=self.device),
                 allocate(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.config.num_layers)]
