"""trio-llm's public face: the Engine facade, the HTTP server, the CLI and client.

Names are imported on first use, so `trio_llm.api.client` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "trio_llm.api.engine",
    "EngineStatistics": "trio_llm.api.engine",
    "RequestOutputStream": "trio_llm.api.engine",
    "EmbeddingOutput": "trio_llm.api.engine",
    "PoolingParams": "trio_llm.actors.messages",
    "ChatTemplateOptions": "trio_llm.actors.messages",
    "EngineConfig": "trio_llm.actors.config",
    "SamplingParams": "trio_llm.actors.messages",
    "RequestOutput": "trio_llm.actors.messages",
    "EngineError": "trio_llm.actors.errors",
    "EngineDead": "trio_llm.actors.errors",
    "QueueFull": "trio_llm.actors.errors",
    "RequestRejected": "trio_llm.actors.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trio_llm.api' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
