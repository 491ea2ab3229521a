"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Qwen2's attention (q/k/v biases, ``qkv_bias``, no o_proj bias) and, in every
sparse layer, the routed experts of Qwen3-MoE plus a shared expert (a SwiGLU of
``shared_expert_intermediate_size``) whose output is scaled by a sigmoid gate
(``shared_expert_gate``) and added: the block the Qwen3.5/3.6 MoE models use too.
"""

from __future__ import annotations

from typing import Any

from trio_llm.gpu.layers.moe import moe_or_mlp, stacks_shared_expert
from trio_llm.gpu.models.base import ModelFamily, register_family
from trio_llm.gpu.models.config import (
    ModelConfig,
    MoeConfig,
    check_activation,
    check_no_sliding_window,
    common_fields,
    qwen_moe_fields,
)
from trio_llm.gpu.models.weights import TargetMap, moe_or_mlp_targets


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    check_activation(data, source)
    check_no_sliding_window(data, source)
    fields = common_fields(data, source, architecture=architecture, family="qwen2_moe")
    fields |= {"qkv_bias": bool(data.get("qkv_bias", True)), "o_proj_bias": False,
               "mlp_bias": False}
    return MoeConfig(**fields, **qwen_moe_fields(data, source),
                     shared_expert_intermediate_size=int(
                         data["shared_expert_intermediate_size"]))


def feed_forward_targets(targets: TargetMap, config: ModelConfig, layer_index: int, ours: str,
                         theirs: str) -> None:
    """Qwen3-MoE's tensors and, in a sparse layer, the shared expert's."""
    moe_or_mlp_targets(targets, config, layer_index, ours, theirs)
    assert isinstance(config, MoeConfig)
    if not config.is_moe_layer(layer_index):
        return
    block, ours_block = theirs + "mlp.", ours + "mlp."
    shared = "the shared expert's intermediate size"
    size = config.shared_expert_intermediate_size
    if stacks_shared_expert(config.moe_intermediate_size, size):
        # expert num_experts of the stacked weights, its gate the router's last row
        gate_up, down = "experts_gate_up", "experts_down"
        expert: int | None = config.num_experts
        targets.rows(block + "shared_expert_gate.weight", ours_block + "gate.weight",
                     config.num_experts, 1)
    else:
        gate_up, down, expert = "shared_expert_gate_up.weight", "shared_expert_down.weight", None
        targets.whole(block + "shared_expert_gate.weight",
                      ours_block + "shared_expert_gate.weight")
    targets.column_parallel(block + "shared_expert.", ours_block + gate_up,
                            [("gate_proj", size, shared), ("up_proj", size, shared)], "weight",
                            expert=expert)
    targets.row_parallel(block + "shared_expert.down_proj.weight", ours_block + down, size,
                         shared, expert=expert)


FAMILY = register_family(ModelFamily(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    parse_config=parse_config,
    feed_forward=moe_or_mlp,
    feed_forward_targets=feed_forward_targets,
    model_types={"qwen2_moe": "Qwen2MoeForCausalLM"},
))
