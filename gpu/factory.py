"""The executor an engine drives, chosen from its config (the facade calls this)."""

from __future__ import annotations

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.cuda_executor import CudaModelExecutor
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.rank_executor import create_rank_executor
from trio_llm.gpu.tp_executor import TensorParallelExecutor


def create_executor(config: EngineConfig
                    ) -> ModelExecutor | CudaModelExecutor | TensorParallelExecutor:
    """With ``tensor_parallel_size`` > 1 one that drives a worker process per rank
    (gpu/tp_executor.py); else the pipelined CUDA executor where the model runs on
    CUDA (gpu/cuda_executor.py), or the CPU's (gpu/executor.py)."""
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor.create(config)
    return create_rank_executor(config)
