"""A model's architecture, read from a Hugging Face config.json: what every family shares.

``ModelConfig`` holds what the shared layers (attention, norms, rotary, the
embedding and lm_head) need; a family (gpu/models/) parses config.json into it,
or into a subclass with its own fields (the experts of a Mixture-of-Experts
family), with the helpers below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trio_llm.gpu.errors import ModelLoadError
from trio_llm.gpu.layers.rotary import SUPPORTED_ROPE_TYPES, RopeConfig
from trio_llm.gpu.quantization import CheckpointQuantization

__all__ = ["HybridConfig", "ModelConfig", "ModelLoadError", "MoeConfig", "RopeConfig",
           "common_fields", "moe_fields", "parse_rope", "qwen_moe_fields", "read_config_json"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the model code needs of every family; a family's subclass adds its own."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig
    checkpoint_dtype: str | None = None
    # how the checkpoint stores FP8 weights (gpu/quantization.py); None: unquantized
    quantization: CheckpointQuantization | None = None
    # What the hybrid family (Qwen3.5, Qwen3-Next) changes in the shared layers; the
    # defaults are every other family's. The share of each head's dimensions rotated:
    partial_rotary_factor: float = 1.0
    # a sigmoid gate on the attention output (q_proj's rows twice the heads' size)
    attention_output_gate: bool = False
    # every RMSNorm of the (1 + weight) form (gpu/layers/norm.py's OffsetRMSNorm)
    offset_norms: bool = False
    # the checkpoint names' prefix of the decoder (embed_tokens, layers, norm)
    weight_prefix: str = "model."
    # the checkpoint has a vision tower (a ...ForConditionalGeneration): its weights are
    # skipped, the text model is served, and image inputs are refused
    has_vision_tower: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear_attention_layer(self, layer_index: int) -> bool:
        """Layer ``layer_index`` mixes tokens by linear attention (a state per request),
        not by attention over the KV cache: never, but in the hybrid family."""
        return False

    def tensor_parallel_sizes(self) -> list[tuple[int, str]]:
        """The sizes a tensor-parallel split divides, each named for the error message."""
        return [(self.num_heads, "the number of attention heads"),
                (self.num_kv_heads, "the number of KV heads"),
                (self.intermediate_size, "the intermediate size")]


@dataclass(frozen=True, slots=True)
class MoeConfig(ModelConfig):
    """A Mixture-of-Experts family's config: the dense fields, and its experts'.

    Layer i is an MoE block unless it is in ``mlp_only_layers`` or ``(i + 1)`` is not a
    multiple of ``decoder_sparse_step`` (then a dense MLP of ``intermediate_size``)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_weights_in_float32: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def is_moe_layer(self, layer_index: int) -> bool:
        return (layer_index not in self.mlp_only_layers and self.num_experts > 0
                and (layer_index + 1) % self.decoder_sparse_step == 0)

    def tensor_parallel_sizes(self) -> list[tuple[int, str]]:
        sizes = [(self.num_heads, "the number of attention heads"),
                 (self.num_kv_heads, "the number of KV heads")]
        if self.num_experts:
            sizes.append((self.moe_intermediate_size, "the experts' intermediate size"))
        if not all(self.is_moe_layer(index) for index in range(self.num_layers)):
            sizes.append((self.intermediate_size, "the intermediate size"))
        if self.shared_expert_intermediate_size:
            sizes.append((self.shared_expert_intermediate_size,
                          "the shared expert's intermediate size"))
        return sizes


@dataclass(frozen=True, slots=True)
class HybridConfig(MoeConfig):
    """The hybrid family's config (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): full-attention
    layers among Gated DeltaNet linear-attention layers (``layer_types``), each linear
    layer with ``linear_num_key_heads`` query/key heads of ``linear_key_head_dim`` and
    ``linear_num_value_heads`` value heads of ``linear_value_head_dim``, a causal
    depthwise conv1d of ``linear_conv_kernel_dim`` over its q/k/v. ``num_experts`` 0: a
    dense MLP in every layer."""

    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    def is_linear_attention_layer(self, layer_index: int) -> bool:
        return self.layer_types[layer_index] == "linear_attention"

    def tensor_parallel_sizes(self) -> list[tuple[int, str]]:
        """The attention heads, the linear-attention heads, then the MLP's or experts'.
        (MoeConfig's by name: zero-argument super() fails in a slotted dataclass.)"""
        sizes = MoeConfig.tensor_parallel_sizes(self)
        linear = [(self.linear_num_key_heads, "the number of linear-attention key heads"),
                  (self.linear_num_value_heads, "the number of linear-attention value heads")]
        return sizes[:2] + linear + sizes[2:]


def moe_fields(data: dict[str, Any], source: str, *, num_experts_key: str) -> dict[str, Any]:
    """The experts' fields of config.json, as MoeConfig's keyword arguments."""
    num_experts = int(data.get(num_experts_key) or data.get("num_local_experts")
                      or data.get("num_experts") or 0)
    top_k = int(data["num_experts_per_tok"])
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({top_k}) must lie in 1.."
                             f"{num_experts_key} ({num_experts})")
    step = int(data.get("decoder_sparse_step", 1))
    if step < 1:
        raise ModelLoadError(f"{source}: decoder_sparse_step must be at least 1, not {step}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": step,
        "mlp_only_layers": tuple(int(index) for index in data.get("mlp_only_layers") or ()),
    }


def qwen_moe_fields(data: dict[str, Any], source: str, *,
                    default_norm_topk_prob: bool = False) -> dict[str, Any]:
    """The Qwen MoE families' expert fields (Qwen2-MoE, Qwen3-MoE, the hybrid family):
    ``moe_fields`` of ``num_experts``, each expert's ``moe_intermediate_size``, and
    whether the top-k probabilities are renormalised."""
    return moe_fields(data, source, num_experts_key="num_experts") | {
        "moe_intermediate_size": int(data["moe_intermediate_size"]),
        "norm_topk_prob": bool(data.get("norm_topk_prob", default_norm_topk_prob)),
    }


def read_config_json(directory: Path) -> tuple[dict[str, Any], str]:
    """``directory``/config.json's contents and its path (for messages); any problem is a
    ModelLoadError naming the file."""
    path = directory / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing file (every model directory needs config.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return data, str(path)


def check_activation(data: dict[str, Any], source: str, key: str = "hidden_act") -> None:
    activation = data.get(key, "silu")
    if activation != "silu":
        raise ModelLoadError(f"{source}: unsupported {key} {activation!r} (only silu)")


def check_no_sliding_window(data: dict[str, Any], source: str) -> None:
    if data.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: sliding-window attention is not supported")


def parse_rope(data: dict[str, Any], source: str) -> RopeConfig:
    """RoPE from transformers 5's ``rope_parameters`` or the older rope_theta/rope_scaling."""
    parameters = dict(data.get("rope_scaling") or {})
    parameters.update(data.get("rope_parameters") or {})
    theta = parameters.get("rope_theta", data.get("rope_theta", 10000.0))
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope type {rope_type!r}; "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(parameters["factor"]),
        low_freq_factor=float(parameters["low_freq_factor"]),
        high_freq_factor=float(parameters["high_freq_factor"]),
        original_max_position_embeddings=int(parameters["original_max_position_embeddings"]),
    )


def common_fields(data: dict[str, Any], source: str, *, architecture: str,
                  family: str) -> dict[str, Any]:
    """The fields every decoder-only family reads the same way, as ModelConfig's keyword
    arguments; a family adds or overrides its own (biases, norms, experts)."""
    num_heads = int(data["num_attention_heads"])
    hidden_size = int(data["hidden_size"])
    attention_bias = bool(data.get("attention_bias", False))
    return {
        "architecture": architecture,
        "family": family,
        "vocab_size": int(data["vocab_size"]),
        "hidden_size": hidden_size,
        "intermediate_size": int(data["intermediate_size"]),
        "num_layers": int(data["num_hidden_layers"]),
        "num_heads": num_heads,
        "num_kv_heads": int(data.get("num_key_value_heads") or num_heads),
        "head_dim": int(data.get("head_dim") or hidden_size // num_heads),
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(data.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
        "qkv_bias": attention_bias,
        "o_proj_bias": attention_bias,
        "mlp_bias": bool(data.get("mlp_bias", False)),
        "qk_norm": False,
        "rope": parse_rope(data, source),
        "checkpoint_dtype": data.get("dtype") or data.get("torch_dtype"),
    }
