"""The executor of one device (or of one rank's shard): CUDA's where the device is a
GPU, else the CPU's. Apart from both, so that neither imports the other to choose."""

from __future__ import annotations

import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.cuda_executor import CudaModelExecutor
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import resolve_device
from trio_llm.gpu.tensor_parallel import TensorParallel


def create_rank_executor(config: EngineConfig, *, parallel: TensorParallel | None = None,
                         device: torch.device | None = None
                         ) -> ModelExecutor | CudaModelExecutor:
    """The executor of one model (or of one rank's shard): CUDA's where ``device``
    (default: the config's) is a GPU, else the CPU's."""
    device = device or resolve_device(config.device)
    if device.type == "cuda":
        return CudaModelExecutor.create(config, parallel=parallel, device=device)
    return ModelExecutor.create(config, parallel=parallel, device=device)
