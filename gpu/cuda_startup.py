"""The CUDA executor's start-up: the KV cache's report, the eager path's warm-up, and the
capture of CUDA graphs within their time and memory budgets."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from trio_llm.actors.messages import (
    NewRequestData,
    SamplingOptions,
    ScheduledBatch,
    ScheduledRequest,
)
from trio_llm.gpu.cuda_graphs import DECODE_BATCH_SIZES, VARLEN_GRAPH_TOKENS, no_garbage_collection
from trio_llm.gpu.executor import GIB, kv_cache_summary

if TYPE_CHECKING:
    from trio_llm.gpu.cuda_executor import CudaModelExecutor

# the executor's log: operators read (and filter) start-up lines under its name
logger = logging.getLogger("trio_llm.gpu.cuda_executor")


def report_kv_cache(executor: CudaModelExecutor) -> None:
    """Log the KV cache's size and dtype, and the state cache's (linear-attention layers)."""
    logger.info("%s", kv_cache_summary(executor.model, executor.num_kv_blocks,
                                       executor.block_size))
    if executor.state_caches:  # a model with linear-attention layers
        slot_bytes = executor.model.state_bytes_per_slot
        logger.info("state cache: %d slots of %.1f MiB over %d linear-attention layers, "
                    "%.2f GiB (%s)", executor.num_state_slots, slot_bytes / 2**20,
                    len(executor.state_caches), executor.num_state_slots * slot_bytes / GIB,
                    executor.device)


def warm_up(executor: CudaModelExecutor) -> None:
    """One eager prefill step with sampling, so that Triton compiles the eager path's
    kernels at start-up rather than during the first request. (It writes KV cache
    block 0, which holds nothing yet.)"""
    started = time.perf_counter()
    request_id = "warm-up"
    plain = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                            num_logprobs=None, min_tokens=0, banned_token_ids=[])
    # the second step compiles the sampling kernel's variant with penalties
    penalized = msgspec.structs.replace(plain, repetition_penalty=1.1)
    num_tokens = min(executor.block_size, executor.max_model_len)
    for sampling in (plain, penalized):
        # a model with state slots: slot 0, which (like block 0) holds nothing yet, and
        # which a request starting from scratch never reads
        new_request = NewRequestData(request_id=request_id, sampling=sampling,
                                     prompt_token_ids=[0] * num_tokens,
                                     state_slot=0 if executor.state_caches else None)
        batch = ScheduledBatch(
            step_id=-1, new_requests=[new_request],
            requests=[ScheduledRequest(request_id=request_id, token_ids=[0] * num_tokens,
                                       input_from_previous_step=False,
                                       num_computed_tokens=0, new_block_ids=[0],
                                       sample=True, output_index=0)],
            finished_request_ids=[], num_tokens=num_tokens)
        executor.collect(executor.launch(batch))
        executor.planner.forget(request_id)
    executor.reset_statistics()
    logger.info("warmed up the eager path in %.1f s", time.perf_counter() - started)

def capture_graphs(executor: CudaModelExecutor) -> None:
    """Decode graphs by batch size, then varlen graphs by token count, each family
    largest first (the smaller reuse the larger's memory in the shared pool), within
    the time and memory budgets; steps beyond what was captured run eagerly."""
    options = executor.options
    decode_sizes = sorted({size for size in DECODE_BATCH_SIZES if size < options.max_num_seqs}
                          | {options.max_num_seqs}, reverse=True)
    # A varlen graph of max_num_seqs + 1 tokens would have as many sequence slots as
    # tokens, and the attention would take it for a decode step (one token a sequence):
    # that size is left to the next larger graph.
    varlen_sizes = sorted(({size for size in VARLEN_GRAPH_TOKENS
                            if size < options.max_num_batched_tokens}
                           | {options.max_num_batched_tokens}) - {options.max_num_seqs + 1},
                          reverse=True)
    pool = None
    if executor.device.type == "cuda":
        pool = torch.cuda.graph_pool_handle()
        # capture empties the allocator's cache: empty it first, or what it frees
        # would count against the graphs' memory
        torch.cuda.empty_cache()
    memory_before = reserved_bytes(executor)
    started = time.perf_counter()
    with no_garbage_collection():
        capture_each(executor, decode_sizes, varlen_sizes, started, memory_before,
                     pool)
    if executor.device.type == "cuda":
        torch.cuda.synchronize(executor.device)
    executor.graph_capture_seconds = time.perf_counter() - started
    executor.graph_memory_bytes = reserved_bytes(executor) - memory_before
    logger.info("captured %d decode CUDA graphs (batch sizes %s) and %d varlen graphs "
                "(token counts %s) in %.1f s, %.2f GiB",
                len(executor.decode_graphs.graphs),
                ",".join(map(str, sorted(executor.decode_graphs.graphs))),
                len(executor.varlen_graphs.graphs),
                ",".join(map(str, sorted(executor.varlen_graphs.graphs))),
                executor.graph_capture_seconds, executor.graph_memory_bytes / GIB)

def capture_each(executor: CudaModelExecutor, decode_sizes: list[int],
                 varlen_sizes: list[int], started: float,
                  memory_before: int, pool: Any) -> None:
    for graphs, sizes in ((executor.decode_graphs, decode_sizes),
                          (executor.varlen_graphs, varlen_sizes)):
        for size in sizes:
            # Tensor-parallel ranks must hold the same graphs: a step padded to a
            # graph on one rank and run unpadded on another would hand their
            # collectives tensors of different sizes. Each rank's budget can run
            # out at a different size; the first rank out stops them all.
            within = within_capture_budget(executor, started, memory_before, size)
            if not executor.model.parallel.min_over_ranks(int(within), executor.device):
                break
            graphs.capture(size, executor.compute, pool)

def within_capture_budget(executor: CudaModelExecutor, started: float, memory_before: int,
                          size: int) -> bool:
    options = executor.options
    if time.perf_counter() - started > options.graph_capture_budget_seconds:
        logger.warning("CUDA graph capture stopped at its %.0f s budget; steps up to size "
                       "%d run eagerly", options.graph_capture_budget_seconds, size)
        return False
    if reserved_bytes(executor) - memory_before > options.graph_memory_budget_gib * GIB:
        logger.warning("CUDA graph capture stopped at its %.1f GiB budget; steps up to "
                       "size %d run eagerly", options.graph_memory_budget_gib, size)
        return False
    return True

def reserved_bytes(executor: CudaModelExecutor) -> int:
    if executor.device.type != "cuda":
        return 0
    return int(torch.cuda.memory_reserved(executor.device))
