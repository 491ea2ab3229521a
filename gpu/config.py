"""A model's architecture, read from a Hugging Face config.json.

One frozen dataclass for the Llama, Qwen2 and Qwen3 dense families; every
difference between them the model code cares about is a field here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Architecture name in config.json -> family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
FAMILY_ARCHITECTURES = {family: name for name, family in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base ``theta``, and the llama3 frequency scaling if any."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model code needs to build one of the supported families."""

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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, directory: Path) -> ModelConfig:
        """Read ``directory``/config.json; any problem is a ModelLoadError naming the file."""
        path = directory / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing file (every model directory needs config.json)")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as error:
            raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Parse config.json's contents; ``source`` names the file in error messages."""
        try:
            return _parse(data, source)
        except ModelLoadError:
            raise
        except (KeyError, TypeError, ValueError) as error:
            raise ModelLoadError(f"{source}: missing or malformed field {error}") from error


def _architecture(data: dict[str, Any], source: str) -> tuple[str, str]:
    names = data.get("architectures") or []
    if not names and data.get("model_type") in FAMILY_ARCHITECTURES:
        names = [FAMILY_ARCHITECTURES[data["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name, SUPPORTED_ARCHITECTURES[name]
    found = ", ".join(names) or f"model_type {data.get('model_type')!r}"
    raise ModelLoadError(
        f"{source}: unsupported architecture {found}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _check_supported(data: dict[str, Any], source: str) -> None:
    activation = data.get("hidden_act", "silu")
    if activation != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {activation!r} (only silu)")
    if data.get("use_sliding_window"):
        raise ModelLoadError(f"{source}: sliding-window attention is not supported")


def _rope(data: dict[str, Any], source: str) -> RopeConfig:
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


def _parse(data: dict[str, Any], source: str) -> ModelConfig:
    architecture, family = _architecture(data, source)
    _check_supported(data, source)
    num_heads = int(data["num_attention_heads"])
    hidden_size = int(data["hidden_size"])
    attention_bias = bool(data.get("attention_bias", False))
    return ModelConfig(
        architecture=architecture,
        family=family,
        vocab_size=int(data["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(data["intermediate_size"]),
        num_layers=int(data["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(data.get("num_key_value_heads") or num_heads),
        head_dim=int(data.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o_proj bias; the others follow attention_bias.
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_proj_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(data.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        rope=_rope(data, source),
        checkpoint_dtype=data.get("dtype") or data.get("torch_dtype"),
    )
