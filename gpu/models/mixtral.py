"""Mixtral (``MixtralForCausalLM``: Mixtral-8x7B, 8x22B).

Llama's attention (no biases, no q/k norms) and, in every layer, a softmax router
over ``num_local_experts`` SwiGLU experts of ``intermediate_size``; the top
``num_experts_per_tok`` always renormalised and kept in float32 (gpu/layers/moe.py).
Checkpoints name the block ``block_sparse_moe`` and an expert's projections w1
(gate), w3 (up) and w2 (down).
"""

from __future__ import annotations

from typing import Any

from trio_llm.gpu.layers.moe import moe_or_mlp
from trio_llm.gpu.models.base import ModelFamily, register_family
from trio_llm.gpu.models.config import (
    ModelConfig,
    ModelLoadError,
    MoeConfig,
    check_activation,
    common_fields,
    moe_fields,
)
from trio_llm.gpu.models.weights import TargetMap, moe_block_targets


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    check_activation(data, source)
    if data.get("sliding_window") is not None:
        raise ModelLoadError(f"{source}: sliding-window attention is not supported "
                             f"(sliding_window {data['sliding_window']})")
    fields = common_fields(data, source, architecture=architecture, family="mixtral")
    return MoeConfig(**fields | {"mlp_bias": False},
                     **moe_fields(data, source, num_experts_key="num_local_experts"),
                     moe_intermediate_size=int(data["intermediate_size"]),
                     norm_topk_prob=True, router_weights_in_float32=True)


def feed_forward_targets(targets: TargetMap, config: ModelConfig, layer_index: int, ours: str,
                         theirs: str) -> None:
    assert isinstance(config, MoeConfig)
    moe_block_targets(targets, ours + "mlp.", theirs + "block_sparse_moe.", config.num_experts,
                      config.moe_intermediate_size, ("w1", "w3", "w2"))


FAMILY = register_family(ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    parse_config=parse_config,
    feed_forward=moe_or_mlp,
    feed_forward_targets=feed_forward_targets,
    model_types={"mixtral": "MixtralForCausalLM"},
))
