"""Qwen3-Next (``Qwen3NextForCausalLM``): the hybrid family's predecessor.

The layers are Qwen3.5-MoE's (gpu/models/qwen3_5.py): Gated DeltaNet linear
attention beside gated attention with partial rotary, ``(1 + weight)`` norms,
Qwen2-MoE's experts with a gated shared expert (``norm_topk_prob``,
``decoder_sparse_step`` and ``mlp_only_layers`` as Qwen2-MoE reads them). What
differs is the checkpoint layout of a linear-attention layer: ``in_proj_qkvz``
and ``in_proj_ba`` group their rows by key head (for each key head its q, k,
then its value heads' v and z; its value heads' b, then a). Each rank reads its
key heads' groups and regroups the rows, at load time, into the layer's fused
``in_proj`` (rows ``[q | k | v | z | b | a]``); the conv weight's channels are
q, k, v as in Qwen3.5.
"""

from __future__ import annotations

from typing import Any

from trio_llm.gpu.layers.linear_attention import local_shape
from trio_llm.gpu.layers.moe import moe_or_mlp
from trio_llm.gpu.models.base import ModelFamily, register_family
from trio_llm.gpu.models.config import HybridConfig, ModelConfig, check_no_sliding_window
from trio_llm.gpu.models.qwen2_moe import feed_forward_targets
from trio_llm.gpu.models.qwen3_5 import (
    ba_rows,
    common_linear_attention_targets,
    hybrid_fields,
    linear_attention,
    qkv_pieces,
)
from trio_llm.gpu.models.weights import TargetMap, gathered


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    check_no_sliding_window(data, source)
    fields = hybrid_fields(data, source, architecture=architecture, family="qwen3_next")
    fields["norm_topk_prob"] = bool(data.get("norm_topk_prob", False))
    return HybridConfig(**fields)


def linear_attention_targets(targets: TargetMap, config: ModelConfig, layer_index: int,
                             ours: str, theirs: str) -> None:
    """A Qwen3-Next linear-attention layer's tensors, grouped by key head."""
    assert isinstance(config, HybridConfig)
    parallel = targets.parallel
    shape = local_shape(config, parallel)
    key_dim, value_dim = config.linear_key_head_dim, config.linear_value_head_dim
    group_values = config.linear_num_value_heads // config.linear_num_key_heads
    group_rows = 2 * key_dim + 2 * group_values * value_dim
    groups = range(parallel.rank * shape.num_key_heads,
                   (parallel.rank + 1) * shape.num_key_heads)
    # within a group: q, k, v, z; each part of every group in turn
    offsets_and_sizes = [(0, key_dim), (key_dim, key_dim),
                         (2 * key_dim, group_values * value_dim),
                         (2 * key_dim + group_values * value_dim, group_values * value_dim)]
    qkvz = [(group * group_rows + offset, size) for offset, size in offsets_and_sizes
            for group in groups]
    in_proj = ours + "in_proj.weight"
    num_key_heads = config.linear_num_key_heads
    row = gathered(targets, theirs + "in_proj_qkvz.weight", in_proj, 0,
                   num_key_heads * group_rows, qkvz)
    ba = [(group * 2 * group_values + offset, group_values) for offset in (0, group_values)
          for group in groups]
    gathered(targets, theirs + "in_proj_ba.weight", *ba_rows(targets, ours, row),
             num_key_heads * 2 * group_values, ba)
    conv_channels = 2 * num_key_heads * key_dim + config.linear_num_value_heads * value_dim
    gathered(targets, theirs + "conv1d.weight", ours + "conv_weight", 0, conv_channels,
             qkv_pieces(shape, parallel, config))
    common_linear_attention_targets(targets, config, shape, ours, theirs)


FAMILY = register_family(ModelFamily(
    name="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    parse_config=parse_config,
    feed_forward=moe_or_mlp,
    feed_forward_targets=feed_forward_targets,
    model_types={"qwen3_next": "Qwen3NextForCausalLM"},
    linear_attention=linear_attention,
    linear_attention_targets=linear_attention_targets,
))
