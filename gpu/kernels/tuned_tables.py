"""Where a kernel's tuned tables are found: one JSON file per layer shape and device
model, named by the kernel (gpu/kernels/fused_moe.py's MoE tables, gpu/kernels/fp8_gemm.py's
row-wise GEMM tables), searched first in the folder an environment variable names (a
tuning run's output, tried before it is committed), then in the kernel's own folder of
committed tables."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


@functools.cache
def device_name(device: torch.device) -> str:
    """The device model as a file name takes it ("NVIDIA_H100_80GB_HBM3"; "cpu")."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name.replace(" ", "_")


def load_table(name: str, folder_variable: str, builtin: Path,
               read: Callable[[Path], Any]) -> Any:
    """The table file ``name`` in the folder ``folder_variable`` names, else in
    ``builtin``, as ``read`` (the kernel's parser) gives it, read once; () where neither
    folder has one."""
    return _read_table(_find_table(name, os.environ.get(folder_variable, ""), builtin), read)


@functools.cache
def _read_table(path: Path | None, read: Callable[[Path], Any]) -> Any:
    return read(path) if path is not None else ()


@functools.cache  # a lookup a launch: eager steps look tables up layer by layer
def _find_table(name: str, folder: str, builtin: Path) -> Path | None:
    for directory in ([Path(folder)] if folder else []) + [builtin]:
        path = directory / name
        if path.is_file():
            return path
    # once a table name (vLLM says the same of its MoE configs): the defaults may be slower
    logger.info("no tuned table %s in %s: the kernel's default tiles serve this shape",
                name, builtin)
    return None
