"""Default sampling parameters from the checkpoint's generation_config.json, as vLLM reads them.

``--generation-config auto`` (the default) reads the model directory's file,
``vllm`` reads none (vLLM's own defaults), any other value is a directory
holding one. Of its fields, those vLLM takes are read: temperature, top_p,
top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. A value
equal to transformers' own default for the field is left out, as vLLM leaves
it out (it compares the file with transformers' defaults): a file that says
``top_k: 50`` does not turn top-k on. A request's own values always win; a
default only fills what the request leaves out (max_tokens also caps it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import msgspec

from trio_llm.actors.messages import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json's field -> SamplingParams' field
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a value equal to one of these is no default
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                          "repetition_penalty": 1.0}


class GenerationDefaults(msgspec.Struct, frozen=True, kw_only=True):
    """The checkpoint's recommended sampling parameters; None: not given."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def given(self) -> dict[str, Any]:
        """The defaults the checkpoint sets, by SamplingParams' names."""
        return {name: value for name, value in msgspec.structs.asdict(self).items()
                if value is not None}

    def sampling_params(self, base: SamplingParams | None = None) -> SamplingParams:
        """``base`` (default: SamplingParams()) with these defaults in its fields.
        A default SamplingParams has no field for yet is left out."""
        base = base or SamplingParams()
        known = set(base.__struct_fields__)
        changes = {name: value for name, value in self.given().items() if name in known}
        return msgspec.structs.replace(base, **changes) if changes else base

    def capped_max_tokens(self, requested: int | None) -> int | None:
        """A request's max_tokens, the default where it gives none, never over
        the default (vLLM takes the smaller)."""
        if requested is None or self.max_tokens is None:
            return requested if requested is not None else self.max_tokens
        return min(requested, self.max_tokens)


def read_generation_defaults(setting: str, model_path: str | Path) -> GenerationDefaults:
    """The defaults ``--generation-config setting`` names for the model at ``model_path``.

    Raises FileNotFoundError when ``setting`` is a directory without the file.
    """
    if setting == "vllm":
        return GenerationDefaults()
    directory = Path(model_path) if setting == "auto" else Path(setting)
    path = directory / GENERATION_CONFIG_FILE
    if not path.is_file():
        if setting == "auto":
            return GenerationDefaults()
        raise FileNotFoundError(f"--generation-config {setting}: no {GENERATION_CONFIG_FILE} "
                                f"in {directory}")
    data = json.loads(path.read_text(encoding="utf-8"))
    fields = data if isinstance(data, dict) else {}
    given = {_FIELDS[name]: value for name, value in fields.items()
             if name in _FIELDS and value is not None
             and value != _TRANSFORMERS_DEFAULTS.get(name)}
    try:
        defaults = msgspec.convert(given, GenerationDefaults)
    except msgspec.ValidationError as error:
        raise ValueError(f"{path}: {error}") from None
    if given:
        logger.info("default sampling parameters from %s: %s (--generation-config vllm "
                    "ignores them)", path, given)
    return defaults
