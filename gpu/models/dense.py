"""The dense decoder family: Llama, Qwen2 and Qwen3.

Every layer is attention then a SwiGLU MLP (gpu/layers/). What differs between
the three is read from config.json: Qwen2 always has q/k/v biases and no o_proj
bias (the others follow ``attention_bias``), Qwen3 norms each head's queries and
keys (``qk_norm``), Llama 3.1 scales its rotary frequencies.

On the CPU, gpu/models/cpu_fused.py runs a whole step of this family as one
compiled call (gpu/kernels/cpu_layers.py's ``_forward_layers``), bit for bit the
fused forward's operations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trio_llm.gpu.layers.mlp import MLP
from trio_llm.gpu.models.base import ModelFamily, register_family
from trio_llm.gpu.models.config import (
    ModelConfig,
    check_activation,
    check_no_sliding_window,
    common_fields,
)
from trio_llm.gpu.models.weights import TargetMap, mlp_targets
from trio_llm.gpu.tensor_parallel import TensorParallel

ARCHITECTURE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def parse_config(data: dict[str, Any], source: str, architecture: str) -> ModelConfig:
    family = ARCHITECTURE_FAMILIES[architecture]
    check_activation(data, source)
    check_no_sliding_window(data, source)
    fields = common_fields(data, source, architecture=architecture, family=family)
    if family == "qwen2":  # always q/k/v biases, never an o_proj bias
        fields |= {"qkv_bias": True, "o_proj_bias": False}
    fields["qk_norm"] = family == "qwen3"
    return ModelConfig(**fields)


def feed_forward(config: ModelConfig, layer_index: int, *, dtype: torch.dtype,
                 device: torch.device, parallel: TensorParallel) -> nn.Module:
    return MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias,
               dtype=dtype, device=device, parallel=parallel)


def feed_forward_targets(targets: TargetMap, config: ModelConfig, layer_index: int, ours: str,
                         theirs: str) -> None:
    mlp_targets(targets, theirs + "mlp.", ours + "mlp.", config.intermediate_size,
                config.mlp_bias)


FAMILY = register_family(ModelFamily(
    name="dense",
    architectures=tuple(ARCHITECTURE_FAMILIES),
    parse_config=parse_config,
    feed_forward=feed_forward,
    feed_forward_targets=feed_forward_targets,
    model_types={family: name for name, family in ARCHITECTURE_FAMILIES.items()},
))
