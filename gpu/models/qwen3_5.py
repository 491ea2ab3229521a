"""Qwen3.5 and Qwen3.6, dense and MoE: the hybrid family (``Qwen3_5ForCausalLM``,
``Qwen3_5MoeForCausalLM``, and the checkpoints as Qwen publishes them,
``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``).

Three of every four layers (config.json's ``layer_types``) are Gated DeltaNet
linear attention (gpu/layers/linear_attention.py: a state per request, no KV
cache); the others are attention with a sigmoid output gate, q/k norms and
rotary on the first quarter of each head (``partial_rotary_factor``). Every
RMSNorm but the linear attention's output norm is of the ``(1 + weight)`` form.
The feed-forward block is a SwiGLU MLP (Qwen3.5) or Qwen2-MoE's experts with a
gated shared expert (Qwen3.5-MoE; its router always renormalises the top-k).

A ConditionalGeneration checkpoint holds a vision tower beside the language
model: the text model (``text_config``, weights under ``model.language_model.``)
is served, the vision weights are skipped at load, and the config says the
checkpoint had one (``ModelConfig.has_vision_tower``) so that image inputs can be
refused.

Checkpoint layout of a linear-attention layer: ``in_proj_qkv`` (rows q, k, v),
``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``conv1d.weight`` (channels q, k, v),
``A_log``, ``dt_bias``, ``norm.weight``, ``out_proj.weight``. Each rank reads its
heads' rows of each part (gpu/models/weights.py's ``gathered``) into the layer's
fused ``in_proj``, rows ``[q | k | v | z | b | a]``.
"""

from __future__ import annotations

from typing import Any

import torch

from trio_llm.gpu.layers.linear_attention import GatedDeltaNet, LinearAttentionShape, local_shape
from trio_llm.gpu.layers.moe import moe_or_mlp
from trio_llm.gpu.models.base import ModelFamily, register_family
from trio_llm.gpu.models.config import (
    HybridConfig,
    ModelConfig,
    ModelLoadError,
    check_activation,
    common_fields,
    qwen_moe_fields,
)
from trio_llm.gpu.models.qwen2_moe import feed_forward_targets
from trio_llm.gpu.models.weights import TargetMap, gathered
from trio_llm.gpu.tensor_parallel import TensorParallel

ARCHITECTURE_FAMILIES = {
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
MODEL_TYPES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}
LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' defaults where config.json is silent
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    has_vision_tower = architecture.endswith("ForConditionalGeneration")
    # a ConditionalGeneration config nests the text model's fields in text_config
    text = (data.get("text_config") or data) if has_vision_tower else data
    fields = hybrid_fields(text, source, architecture=architecture,
                           family=ARCHITECTURE_FAMILIES[architecture])
    if has_vision_tower:
        fields |= {"weight_prefix": "model.language_model.", "has_vision_tower": True,
                   "tie_word_embeddings": bool(data.get(
                       "tie_word_embeddings", fields["tie_word_embeddings"]))}
    if fields["family"] == "qwen3_5_moe":
        fields["norm_topk_prob"] = True  # its router always renormalises the top-k
    return HybridConfig(**fields)


def hybrid_fields(data: dict[str, Any], source: str, *, architecture: str,
                  family: str) -> dict[str, Any]:
    """The hybrid family's fields of a (text) config.json, as HybridConfig's keyword
    arguments: the shared ones, the linear attention's, the experts' if any."""
    check_activation(data, source)
    num_layers = int(data["num_hidden_layers"])
    # an MoE config names no dense intermediate size: every layer has experts
    fields = common_fields({"intermediate_size": 0, **data}, source,
                           architecture=architecture, family=family)
    attention_bias = bool(data.get("attention_bias", False))
    fields |= {
        "qkv_bias": attention_bias, "o_proj_bias": attention_bias, "mlp_bias": False,
        "qk_norm": True, "attention_output_gate": True, "offset_norms": True,
        "partial_rotary_factor": partial_rotary_factor(data),
        "layer_types": layer_types(data, source, num_layers),
        "linear_num_key_heads": int(data["linear_num_key_heads"]),
        "linear_num_value_heads": int(data["linear_num_value_heads"]),
        "linear_key_head_dim": int(data["linear_key_head_dim"]),
        "linear_value_head_dim": int(data["linear_value_head_dim"]),
        "linear_conv_kernel_dim": int(data.get("linear_conv_kernel_dim", 4)),
    }
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise ModelLoadError(f"{source}: linear_num_value_heads "
                             f"({fields['linear_num_value_heads']}) must be a multiple of "
                             f"linear_num_key_heads ({fields['linear_num_key_heads']})")
    if int(data.get("num_experts") or 0):
        fields |= qwen_moe_fields(data, source, default_norm_topk_prob=True)
        fields["shared_expert_intermediate_size"] = int(
            data.get("shared_expert_intermediate_size") or 0)
    elif not fields["intermediate_size"]:
        raise ModelLoadError(f"{source}: missing field intermediate_size (a model without "
                             f"experts needs its MLP's size)")
    return fields


def partial_rotary_factor(data: dict[str, Any]) -> float:
    parameters = data.get("rope_parameters") or data.get("rope_scaling") or {}
    return float(parameters.get("partial_rotary_factor",
                                data.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR)))


def layer_types(data: dict[str, Any], source: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's kind, from ``layer_types`` or, as transformers derives it, every
    ``full_attention_interval``-th layer full attention."""
    names = data.get("layer_types")
    if names is None:
        interval = int(data.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
        names = ["full_attention" if (index + 1) % interval == 0 else "linear_attention"
                 for index in range(num_layers)]
    unknown = sorted(set(names) - set(LAYER_TYPES))
    if unknown:
        raise ModelLoadError(f"{source}: unsupported layer_types {unknown}; supported: "
                             f"{', '.join(LAYER_TYPES)}")
    if len(names) != num_layers:
        raise ModelLoadError(f"{source}: layer_types names {len(names)} layers, "
                             f"num_hidden_layers is {num_layers}")
    return tuple(names)


def linear_attention(config: ModelConfig, layer_index: int, *, dtype: torch.dtype,
                     device: torch.device, parallel: TensorParallel) -> GatedDeltaNet:
    assert isinstance(config, HybridConfig)
    return GatedDeltaNet(config, dtype=dtype, device=device, parallel=parallel)


def head_rows(parallel: TensorParallel, num_heads_local: int, head_size: int,
              offset: int = 0) -> tuple[int, int]:
    """(start, length) of this rank's heads' rows in a part of ``head_size`` rows a head
    that starts at row ``offset``."""
    return offset + parallel.rank * num_heads_local * head_size, num_heads_local * head_size


def qkv_pieces(shape: LinearAttentionShape, parallel: TensorParallel,
               config: HybridConfig) -> list[tuple[int, int]]:
    """This rank's rows of a ``[q | k | v]`` tensor (in_proj_qkv, conv1d.weight)."""
    key_size = config.linear_num_key_heads * config.linear_key_head_dim
    return [head_rows(parallel, shape.num_key_heads, shape.key_head_dim),
            head_rows(parallel, shape.num_key_heads, shape.key_head_dim, key_size),
            head_rows(parallel, shape.num_value_heads, shape.value_head_dim, 2 * key_size)]


def linear_attention_targets(targets: TargetMap, config: ModelConfig, layer_index: int,
                             ours: str, theirs: str) -> None:
    """A Qwen3.5 linear-attention layer's tensors: separate q/k/v, z, b, a projections."""
    assert isinstance(config, HybridConfig)
    parallel = targets.parallel
    shape = local_shape(config, parallel)
    value_size = config.linear_num_value_heads * config.linear_value_head_dim
    num_value_heads = config.linear_num_value_heads
    conv_channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim + value_size
    in_proj = ours + "in_proj.weight"
    row = gathered(targets, theirs + "in_proj_qkv.weight", in_proj, 0, conv_channels,
                   qkv_pieces(shape, parallel, config))
    row += gathered(targets, theirs + "in_proj_z.weight", in_proj, row, value_size,
                    [head_rows(parallel, shape.num_value_heads, shape.value_head_dim)])
    ba, row = ba_rows(targets, ours, row)
    for name in ("in_proj_b", "in_proj_a"):
        row += gathered(targets, theirs + f"{name}.weight", ba, row, num_value_heads,
                        [head_rows(parallel, shape.num_value_heads, 1)])
    gathered(targets, theirs + "conv1d.weight", ours + "conv_weight", 0, conv_channels,
             qkv_pieces(shape, parallel, config))
    common_linear_attention_targets(targets, config, shape, ours, theirs)


def ba_rows(targets: TargetMap, ours: str, row: int) -> tuple[str, int]:
    """(the parameter the b and a rows go to, their first row there): after q/k/v/z in
    the fused projection, or a projection of their own (an FP8 checkpoint's:
    GatedDeltaNet)."""
    if ours + "in_proj_ba.weight" in targets.parameters:
        return ours + "in_proj_ba.weight", 0
    return ours + "in_proj.weight", row


def common_linear_attention_targets(targets: TargetMap, config: HybridConfig,
                                    shape: LinearAttentionShape, ours: str,
                                    theirs: str) -> None:
    """What every checkpoint layout of the family names alike: the decay parameters
    (per value head), the output norm (whole) and out_proj (split by its input heads)."""
    parallel = targets.parallel
    for name in ("A_log", "dt_bias"):
        gathered(targets, theirs + name, ours + name, 0, config.linear_num_value_heads,
                 [head_rows(parallel, shape.num_value_heads, 1)])
    targets.whole(theirs + "norm.weight", ours + "norm.weight")
    targets.row_parallel(theirs + "out_proj.weight", ours + "out_proj.weight",
                         config.linear_num_value_heads * config.linear_value_head_dim,
                         "the number of linear-attention value heads")


FAMILY = register_family(ModelFamily(
    name="qwen3_5",
    architectures=tuple(ARCHITECTURE_FAMILIES),
    parse_config=parse_config,
    feed_forward=moe_or_mlp,
    feed_forward_targets=feed_forward_targets,
    model_types=MODEL_TYPES,
    linear_attention=linear_attention,
    linear_attention_targets=linear_attention_targets,
))
