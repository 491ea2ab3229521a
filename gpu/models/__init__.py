"""Model families: one module each, found by the ``architectures`` of config.json.

Importing this package registers every family (gpu/models/base.py's
``register_family``); ``parse_model_config`` and ``read_model_config`` pick the
family of a config.json and let it parse it. docs/architecture.md says how to
add a family.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trio_llm.gpu.models import dense, mixtral, qwen2_moe, qwen3_5, qwen3_moe, qwen3_next
from trio_llm.gpu.models.base import FAMILIES, CausalLM, ModelFamily
from trio_llm.gpu.models.config import ModelConfig, ModelLoadError, read_config_json
from trio_llm.gpu.quantization import parse_quantization

__all__ = ["FAMILIES", "CausalLM", "ModelConfig", "ModelLoadError", "architecture_of",
           "dense", "mixtral", "parse_model_config", "qwen2_moe", "qwen3_5", "qwen3_moe",
           "qwen3_next", "read_model_config"]


def architecture_of(data: dict[str, Any], source: str) -> tuple[str, ModelFamily]:
    """The first of config.json's ``architectures`` a family serves (or its ``model_type``'s
    architecture where it names none), and that family."""
    names = data.get("architectures") or []
    model_type = data.get("model_type")
    if not names:
        names = [family.model_types[model_type] for family in FAMILIES.values()
                 if model_type in family.model_types][:1]
    for name in names:
        if name in FAMILIES:
            return name, FAMILIES[name]
    found = ", ".join(map(str, names)) or f"model_type {data.get('model_type')!r}"
    raise ModelLoadError(f"{source}: unsupported architecture {found}; "
                         f"supported: {', '.join(FAMILIES)}")


def parse_model_config(data: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Parse config.json's contents with its family's parser; ``source`` names the file
    in error messages."""
    try:
        quantization = parse_quantization(data, source)
        architecture, family = architecture_of(data, source)
        config = family.parse_config(data, source, architecture)
        return dataclasses.replace(config, quantization=quantization)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError) as error:
        raise ModelLoadError(f"{source}: missing or malformed field {error}") from error


def read_model_config(directory: Path) -> ModelConfig:
    """Read ``directory``/config.json; any problem is a ModelLoadError naming the file."""
    data, source = read_config_json(directory)
    return parse_model_config(data, source=source)
