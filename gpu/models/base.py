"""The decoder-only language model every family builds, and the family registry.

One forward takes the tokens of every scheduled request concatenated: prefill
chunks and single decode tokens side by side. Each layer writes its keys and
values into the paged cache first, then attends through the block tables, so a
chunk sees the earlier chunks of its prompt and its own tokens alike.

``CausalLM`` is shared: the (vocabulary-parallel) embedding, a stack of
DecoderLayers (gpu/layers/decoder.py), the final norm, the lm_head, the rotary
table and the KV caches. A family (one module of gpu/models/) supplies what
differs: how config.json is parsed, each layer's feed-forward block (a dense
MLP, a Mixture-of-Experts block) and the checkpoint names of its weights. It
registers a ModelFamily under the ``architectures`` names it serves.

Projections are fused at load time: q/k/v into one ``qkv_proj``, gate/up into
one ``gate_up_proj`` (the family's weight map says which checkpoint tensors go
where). Under tensor parallelism (gpu/tensor_parallel.py) each module holds its
rank's shard: its heads, its slice of the intermediate size and of the
vocabulary; the row-parallel ``o_proj`` and ``down_proj`` outputs are summed
over the ranks.

Two forwards compute the same function: ``forward``, the reference in torch
operations, and ``fused_forward``, the same layers through a FusedOps kernel set
(Triton's on CUDA, numba's on the CPU: gpu/models/cuda_fused.py and
cpu_fused.py choose it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.attention import default_attention_backend
from trio_llm.gpu.layers.attention import AttentionMetadata, KVCache
from trio_llm.gpu.layers.decoder import DecoderLayer
from trio_llm.gpu.layers.fused_ops import FusedOps
from trio_llm.gpu.layers.linear import INVARIANT_ROWS_PER_CHUNK, Linear
from trio_llm.gpu.layers.linear_attention import (
    GatedDeltaNet,
    StateCache,
    StateStore,
    local_shape,
)
from trio_llm.gpu.layers.moe import SparseMoeBlock
from trio_llm.gpu.layers.norm import OffsetRMSNorm, RMSNorm
from trio_llm.gpu.layers.rotary import RotaryEmbedding
from trio_llm.gpu.models.config import ModelConfig, ModelLoadError
from trio_llm.gpu.models.weights import Target, TargetMap, bias_suffixes
from trio_llm.gpu.tensor_parallel import TensorParallel

__all__ = ["AttentionMetadata", "CausalLM", "DecoderLayer", "KVCache", "LayerCache",
           "ModelFamily", "StateCache", "StateStore", "register_family"]

# What a layer reads and writes besides its weights: the paged KV cache of an attention
# layer, the state slots of a linear-attention one.
LayerCache = KVCache | StateCache


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """What one family module tells the shared model code.

    ``parse_config(data, source, architecture)``: config.json's contents to its
    ModelConfig (a ModelLoadError naming ``source`` for anything it cannot serve);
    ``feed_forward(config, layer_index, dtype=, device=, parallel=)``: layer
    ``layer_index``'s feed-forward module; ``feed_forward_targets(targets, config,
    layer_index, ours, theirs)``: its checkpoint tensors (names ``theirs`` + ...) and
    where they go (parameters ``ours`` + ...).
    """

    name: str
    architectures: tuple[str, ...]
    parse_config: Callable[[dict[str, Any], str, str], ModelConfig]
    feed_forward: Callable[..., nn.Module]
    feed_forward_targets: Callable[[TargetMap, ModelConfig, int, str, str], None]
    # config.json's model_type -> architecture, for configs without "architectures"
    model_types: dict[str, str] = field(default_factory=dict)
    # A family whose layers mix tokens otherwise than by attention (the hybrid family):
    # ``linear_attention(config, layer_index, dtype=, device=, parallel=)`` layer
    # ``layer_index``'s linear-attention module (for the layers config.is_linear_attention_
    # layer names), and ``linear_attention_targets(targets, config, layer_index, ours,
    # theirs)`` its checkpoint tensors.
    linear_attention: Callable[..., GatedDeltaNet] | None = None
    linear_attention_targets: Callable[[TargetMap, ModelConfig, int, str, str], None] | None \
        = None


# architecture name -> its family; filled by the family modules (gpu/models/__init__.py)
FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    for architecture in family.architectures:
        assert architecture not in FAMILIES, f"{architecture} registered twice"
        FAMILIES[architecture] = family
    return family


def family_of(config: ModelConfig) -> ModelFamily:
    family = FAMILIES.get(config.architecture)
    if family is None:
        raise ModelLoadError(f"unsupported architecture {config.architecture}; "
                             f"supported: {', '.join(FAMILIES)}")
    return family


class CausalLM(nn.Module):
    """A decoder-only language model of one of the registered families.

    ``attention_backend`` is the hook for fast attention kernels: any
    AttentionBackend with the reference's signatures can replace it.
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None,
                 parallel: TensorParallel | None = None,
                 kv_cache_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        # the dtype keys and values are cached in: the model's, or e4m3 (an FP8 cache,
        # with each layer's scales: DecoderLayer.self_attn.kv_scales)
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.device = device
        self.parallel = parallel = parallel or TensorParallel.single()
        # This rank's slice of the vocabulary: [vocab_start, vocab_start + num_vocab_rows).
        self.vocab_start, self.num_vocab_rows = parallel.padded_split(config.vocab_size)
        self.embed_tokens = nn.Parameter(
            torch.empty(self.num_vocab_rows, config.hidden_size, dtype=dtype, device=device),
            requires_grad=False)
        family = self.family = family_of(config)
        self.layers = nn.ModuleList(
            DecoderLayer(config, family.feed_forward(config, index, dtype=dtype, device=device,
                                                     parallel=parallel),
                         dtype=dtype, device=device, parallel=parallel,
                         linear_attn=self._linear_attention(index))
            for index in range(config.num_layers))
        norm = OffsetRMSNorm if config.offset_norms else RMSNorm
        self.norm = norm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                         device=device)
        self.lm_head = Linear(config.hidden_size, self.num_vocab_rows, bias=False, dtype=dtype,
                              device=device)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens
        self.rotary = RotaryEmbedding(config.head_dim,
                                      max_positions or config.max_position_embeddings,
                                      config.rope, device=device, rotary_dim=config.rotary_dim)
        self.attention_backend = default_attention_backend(device)
        self.set_batch_invariant(device.type == "cpu")

    def _linear_attention(self, layer_index: int) -> GatedDeltaNet | None:
        """Layer ``layer_index``'s linear-attention module, if the family makes it one."""
        if not self.config.is_linear_attention_layer(layer_index):
            return None
        if self.family.linear_attention is None:
            raise ModelLoadError(f"{self.config.architecture}: layer {layer_index} is a "
                                 f"linear-attention layer, which the family cannot build")
        return self.family.linear_attention(self.config, layer_index, dtype=self.dtype,
                                            device=self.device, parallel=self.parallel)

    def set_batch_invariant(self, enabled: bool) -> None:
        """Make every row's result independent of the batch it shares (the CPU default)."""
        for module in self.modules():
            if isinstance(module, (Linear, SparseMoeBlock)):
                module.num_rows_per_chunk = INVARIANT_ROWS_PER_CHUNK if enabled else 0

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[Any], metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token; ``kv_caches``
        one LayerCache per layer (``allocate_caches``; every one a KVCache, from
        ``allocate_kv_caches``, in a model without linear attention)."""
        hidden = self.embed(token_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, positions, self.rotary, kv_cache, metadata,
                           self.attention_backend)
        return self.norm(hidden)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        # nn.ModuleList yields Modules; its items are DecoderLayers (built above).
        return cast(list[DecoderLayer], list(self.layers))

    def fused_forward(self, ops: FusedOps, token_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[KVCache], step: Any) -> torch.Tensor:
        """``forward`` through the kernels of ``ops``, each residual add fused into the
        norm after it; ``step`` the attention kernels' view of the step's layout
        (FusedOps says which)."""
        hidden = self.embed(token_ids)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.decoder_layers, kv_caches, strict=True):
            hidden, residual = layer.fused(hidden, residual, positions, self.rotary, kv_cache,
                                           step, self.attention_backend, ops)
        if residual is None:
            return ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def checkpoint_targets(self) -> dict[str, Target]:
        """Every checkpoint tensor name the model needs, and where it goes (for this
        rank's shard of a tensor-parallel model)."""
        config = self.config
        targets = TargetMap(dict(self.named_parameters(remove_duplicate=False)),
                            self.parallel)
        vocabulary = {"vocab_size": config.vocab_size, "vocab_start": self.vocab_start,
                      "num_vocab_rows": self.num_vocab_rows}
        prefix = config.weight_prefix
        targets.vocabulary(f"{prefix}embed_tokens.weight", "embed_tokens", **vocabulary)
        targets.whole(f"{prefix}norm.weight", "norm.weight")
        if not config.tie_word_embeddings:
            targets.vocabulary("lm_head.weight", "lm_head.weight", **vocabulary)
        for index in range(config.num_layers):
            ours, theirs = f"layers.{index}.", f"{config.weight_prefix}layers.{index}."
            linear_targets = self.family.linear_attention_targets
            if config.is_linear_attention_layer(index) and linear_targets is not None:
                linear_targets(targets, config, index, ours + "linear_attn.",
                               theirs + "linear_attn.")
                self.family.feed_forward_targets(targets, config, index, ours, theirs)
                layer_norm_targets(targets, ours, theirs)
                continue
            # in the order the dense model always drew its dummy weights
            qkv_targets(targets, config, ours, theirs)
            self.family.feed_forward_targets(targets, config, index, ours, theirs)
            o_proj_and_norm_targets(targets, config, ours, theirs)
        return targets.targets

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
    def num_attention_layers(self) -> int:
        """The layers that attend over the KV cache (all, but in the hybrid family)."""
        return sum(not self.config.is_linear_attention_layer(index)
                   for index in range(self.config.num_layers))

    @property
    def num_linear_attention_layers(self) -> int:
        return self.config.num_layers - self.num_attention_layers

    @property
    def kv_cache_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take in the caches of the attention layers
        (on this rank: its KV heads only)."""
        config = self.config
        return 2 * self.num_attention_layers * self.num_local_kv_heads * config.head_dim \
            * self.kv_cache_dtype.itemsize

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes one state slot takes over every linear-attention layer (this rank's
        heads): 0 for a model without them."""
        if not self.num_linear_attention_layers:
            return 0
        shape = local_shape(self.config, self.parallel)  # type: ignore[arg-type]
        return self.num_linear_attention_layers * shape.slot_bytes(self.dtype)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        """One (key, value) cache pair per attention layer, each
        [num_blocks, block_size, kv_heads (this rank's), head_dim], in ``kv_cache_dtype``."""
        shape = (num_blocks, block_size, self.num_local_kv_heads, self.config.head_dim)
        # Slots are always written before they are read, so the CPU skips zeroing
        # (and committing) memory it may never touch.
        allocate = torch.zeros if self.device.type != "cpu" else torch.empty
        dtype = self.kv_cache_dtype
        return [(allocate(shape, dtype=dtype, device=self.device),
                 allocate(shape, dtype=dtype, device=self.device))
                for _ in range(self.num_attention_layers)]

    def allocate_state_store(self, num_slots: int) -> StateStore | None:
        """Every linear-attention layer's states, ``num_slots`` slots of them, slot-major
        (one copy moves a slot's states over all the layers); None for a model
        without linear-attention layers."""
        shapes = {layer.linear_attn.shape for layer in self.decoder_layers
                  if layer.linear_attn is not None}
        if not shapes:
            return None
        assert len(shapes) == 1, "every linear-attention layer has the same shape"
        return shapes.pop().allocate(num_slots, self.num_linear_attention_layers,
                                     dtype=self.dtype, device=self.device)

    def allocate_caches(self, num_blocks: int, block_size: int,
                        state_store: StateStore | None) -> list[LayerCache]:
        """Every layer's cache, in layer order: ``allocate_kv_caches``' pair for an
        attention layer, its StateCache (views of ``state_store``, from
        ``allocate_state_store``) for a linear-attention one."""
        kv_caches = iter(self.allocate_kv_caches(num_blocks, block_size))
        state_caches = iter(state_store.layer_caches() if state_store is not None else [])
        caches: list[LayerCache] = [
            next(state_caches) if layer.linear_attn is not None else next(kv_caches)
            for layer in self.decoder_layers]
        assert next(state_caches, None) is None, "one StateCache per linear-attention layer"
        return caches


HEADS, KV_HEADS = "the number of attention heads", "the number of KV heads"


def qkv_targets(targets: TargetMap, config: ModelConfig, ours: str, theirs: str) -> None:
    """A layer's q/k/v, fused into qkv_proj, each split by whole heads."""
    # with an output gate, q_proj holds each head's queries then its gate values
    q_rows = 2 * config.q_size if config.attention_output_gate else config.q_size
    qkv_parts = [("q_proj", q_rows, HEADS), ("k_proj", config.kv_size, KV_HEADS),
                 ("v_proj", config.kv_size, KV_HEADS)]
    for suffix in bias_suffixes(config.qkv_bias):
        targets.column_parallel(theirs + "self_attn.", ours + f"self_attn.qkv_proj.{suffix}",
                                qkv_parts, suffix)


def o_proj_and_norm_targets(targets: TargetMap, config: ModelConfig, ours: str,
                            theirs: str) -> None:
    """A layer's o_proj, split by its input heads, and its norms, whole on every rank."""
    for suffix in bias_suffixes(config.o_proj_bias):
        targets.row_parallel(theirs + f"self_attn.o_proj.{suffix}",
                             ours + f"self_attn.o_proj.{suffix}", config.q_size, HEADS)
    layer_norm_targets(targets, ours, theirs)
    if config.qk_norm:
        for name in ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]:
            targets.whole(theirs + name, ours + name)


def layer_norm_targets(targets: TargetMap, ours: str, theirs: str) -> None:
    """A layer's two pre-norms, whole on every rank."""
    for name in ["input_layernorm.weight", "post_attention_layernorm.weight"]:
        targets.whole(theirs + name, ours + name)
