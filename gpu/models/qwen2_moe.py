"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Qwen2's attention (q/k/v biases, ``qkv_bias``, no o_proj bias) and, in every
sparse layer, the routed experts of Qwen3-MoE plus a shared expert (a SwiGLU of
``shared_expert_intermediate_size``) whose output is scaled by a sigmoid gate
(``shared_expert_gate``) and added: the block the Qwen3.5/3.6 MoE models use too.
"""

from __future__ import annotations

from typing import Any

from trio_llm.gpu.layers.moe import moe_or_mlp
from trio_llm.gpu.models.base import ModelFamily, register_family
from trio_llm.gpu.models.config import (
    ModelConfig,
    MoeConfig,
    check_activation,
    check_no_sliding_window,
    common_fields,
    moe_fields,
)
from trio_llm.gpu.models.dense import mlp_targets
from trio_llm.gpu.models.weights import TargetMap, expert_targets


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    check_activation(data, source)
    check_no_sliding_window(data, source)
    fields = common_fields(data, source, architecture=architecture, family="qwen2_moe")
    fields |= {"qkv_bias": bool(data.get("qkv_bias", True)), "o_proj_bias": False,
               "mlp_bias": False}
    return MoeConfig(**fields, **moe_fields(data, source, num_experts_key="num_experts"),
                     moe_intermediate_size=int(data["moe_intermediate_size"]),
                     norm_topk_prob=bool(data.get("norm_topk_prob", False)),
                     shared_expert_intermediate_size=int(
                         data["shared_expert_intermediate_size"]))


def feed_forward_targets(targets: TargetMap, config: ModelConfig, layer_index: int, ours: str,
                         theirs: str) -> None:
    assert isinstance(config, MoeConfig)
    block, ours_block = theirs + "mlp.", ours + "mlp."
    if not config.is_moe_layer(layer_index):
        mlp_targets(targets, block, ours_block, config.intermediate_size, False)
        return
    targets.whole(block + "gate.weight", ours_block + "gate.weight")
    expert_targets(targets, ours_block, block + "experts.", config.num_experts,
                   config.moe_intermediate_size, ("gate_proj", "up_proj", "down_proj"))
    shared = "the shared expert's intermediate size"
    size = config.shared_expert_intermediate_size
    targets.column_parallel(block + "shared_expert.", ours_block + "shared_expert_gate_up.weight",
                            [("gate_proj", size, shared), ("up_proj", size, shared)], "weight")
    targets.row_parallel(block + "shared_expert.down_proj.weight",
                         ours_block + "shared_expert_down.weight", size, shared)
    targets.whole(block + "shared_expert_gate.weight", ours_block + "shared_expert_gate.weight")


FAMILY = register_family(ModelFamily(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    parse_config=parse_config,
    feed_forward=moe_or_mlp,
    feed_forward_targets=feed_forward_targets,
    model_types={"qwen2_moe": "Qwen2MoeForCausalLM"},
))
