"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's attention (q/k norms, no biases) and, in every layer that
``decoder_sparse_step`` and ``mlp_only_layers`` make sparse, a softmax router
over ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, the top
``num_experts_per_tok`` renormalised where ``norm_topk_prob`` (gpu/layers/moe.py);
the other layers a dense MLP of ``intermediate_size``.
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
    qwen_moe_fields,
)
from trio_llm.gpu.models.weights import moe_or_mlp_targets


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    check_activation(data, source)
    check_no_sliding_window(data, source)
    fields = common_fields(data, source, architecture=architecture, family="qwen3_moe")
    return MoeConfig(**fields | {"qk_norm": True, "mlp_bias": False},
                     **qwen_moe_fields(data, source))


FAMILY = register_family(ModelFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    parse_config=parse_config,
    feed_forward=moe_or_mlp,
    feed_forward_targets=moe_or_mlp_targets,
    model_types={"qwen3_moe": "Qwen3MoeForCausalLM"},
))
