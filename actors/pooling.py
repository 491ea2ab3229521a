"""How a checkpoint served as an embedding model pools (``runner="pooling"``).

A decoder checkpoint pools its last prompt token's hidden state (after the final
norm) and normalises it (L2): Qwen3-Embedding's rule, and vLLM's default for a
causal model run as an embedding model. Where the checkpoint carries a
sentence-transformers configuration (``modules.json`` naming a Pooling module,
whose ``config.json`` names the mode), that decides instead, as vLLM reads it:
``pooling_mode_lasttoken`` or ``pooling_mode_mean_tokens``, normalised only when a
Normalize module follows. A configuration this engine cannot honour (another
pooling mode, a Dense layer after the pooling) is a start-up error naming it,
never a vector of another kind.

``dimensions`` (Matryoshka truncation) is allowed where the model's config.json
declares it (``matryoshka_dimensions``, or ``is_matryoshka``), vLLM's rule.
Plain JSON reading: an API server of the served layout reads it too, without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import PoolingOptions, PoolingParams, PoolingType

_ST_PREFIX = "sentence_transformers.models."
# sentence-transformers' pooling modes that trio-llm computes, by their config key
_POOLING_MODES: dict[str, PoolingType] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
}
# modules that change nothing a decoder's hidden states give: the model itself
_NEUTRAL_MODULES = frozenset({"Transformer"})


class PoolingConfigError(ValueError):
    """The checkpoint asks for pooling this engine does not implement."""


class PoolingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A model's pooling, read once at start-up (``read_pooling_config``)."""

    pooling_type: PoolingType = "last"
    normalize: bool = True
    hidden_size: int
    # Matryoshka: the dimensions it was trained to be cut to (None: any, if
    # ``is_matryoshka``; else none)
    matryoshka_dimensions: list[int] | None = None
    is_matryoshka: bool = False

    def options(self, params: PoolingParams, model_name: str) -> PoolingOptions:
        """A request's pooling, resolved; RequestRejected names a bad ``dimensions``."""
        dimensions = params.dimensions
        if dimensions is not None:
            self._check_dimensions(dimensions, model_name)
            if dimensions == self.hidden_size:
                dimensions = None
        normalize = self.normalize if params.normalize is None else params.normalize
        return PoolingOptions(pooling_type=self.pooling_type, normalize=normalize,
                              dimensions=dimensions)

    def _check_dimensions(self, dimensions: int, model_name: str) -> None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            raise RequestRejected(f"dimensions must be a positive integer, not {dimensions!r}",
                                  param="dimensions")
        if not self.is_matryoshka:
            # vLLM refuses it too: cutting a vector the model was not trained to cut
            raise RequestRejected(
                f"model {model_name!r} does not support Matryoshka representations (its "
                f"config.json declares no matryoshka_dimensions or is_matryoshka): "
                f"dimensions cannot change its {self.hidden_size}", param="dimensions")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise RequestRejected(f"model {model_name!r} supports the Matryoshka dimensions "
                                  f"{allowed} only, not {dimensions}", param="dimensions")
        if dimensions > self.hidden_size:
            raise RequestRejected(f"dimensions {dimensions} is over the model's hidden size "
                                  f"({self.hidden_size})", param="dimensions")


def read_pooling_config(model_path: str | Path) -> PoolingConfig:
    """The pooling of the checkpoint in ``model_path``; PoolingConfigError names what
    it asks for that trio-llm does not do."""
    directory = Path(model_path)
    model_config = _read_json(directory / "config.json") or {}
    hidden_size = model_config.get("hidden_size")
    if not isinstance(hidden_size, int):
        raise PoolingConfigError(f"{directory / 'config.json'} has no hidden_size")
    matryoshka_dimensions = model_config.get("matryoshka_dimensions")
    fields: dict[str, Any] = {
        "hidden_size": hidden_size,
        "matryoshka_dimensions": matryoshka_dimensions,
        "is_matryoshka": bool(matryoshka_dimensions is not None
                              or model_config.get("is_matryoshka", False)),
    }
    fields.update(_sentence_transformers_pooling(directory))
    return msgspec.convert(fields, PoolingConfig)


def _sentence_transformers_pooling(directory: Path) -> dict[str, Any]:
    """pooling_type and normalize from modules.json and its Pooling module's config,
    or nothing (the decoder default) where there is no modules.json."""
    modules = _read_json(directory / "modules.json")
    if modules is None:
        return {}
    if not isinstance(modules, list):
        raise PoolingConfigError(f"{directory / 'modules.json'} is not a list of modules")
    kinds = [str(module.get("type", "")).removeprefix(_ST_PREFIX) for module in modules]
    unknown = [kind for kind in kinds if kind not in {"Pooling", "Normalize"} | _NEUTRAL_MODULES]
    if unknown:
        raise PoolingConfigError(f"the checkpoint's sentence-transformers modules {unknown} "
                                 f"are not supported: trio-llm pools and normalises only")
    pooling = next((module for module, kind in zip(modules, kinds, strict=True)
                    if kind == "Pooling"), None)
    fields: dict[str, Any] = {"normalize": "Normalize" in kinds}
    if pooling is not None:
        fields["pooling_type"] = _pooling_type(directory / pooling.get("path", "") /
                                               "config.json")
    return fields


def _pooling_type(path: Path) -> PoolingType:
    pooling = _read_json(path)
    if not isinstance(pooling, dict):
        raise PoolingConfigError(f"{path} is missing: it says how the model pools")
    modes = [key for key, value in pooling.items()
             if key.startswith("pooling_mode_") and value is True]
    if len(modes) != 1 or modes[0] not in _POOLING_MODES:
        raise PoolingConfigError(
            f"{path} asks for pooling {modes or 'none'}; trio-llm pools one of "
            f"{sorted(_POOLING_MODES)}")
    if pooling.get("include_prompt", True) is not True:
        raise PoolingConfigError(f"{path} sets include_prompt false (instruction tokens left "
                                 f"out of the pooling), which trio-llm does not do")
    return _POOLING_MODES[modes[0]]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as file:
        return json.load(file)
