"""The host's share of a step's launch without a device: planning the step from a
ScheduledBatch and packing its upload, for a 256-request decode step and for a mixed
step (255 decodes and one 3,969-token chunk); the tiny model on the CPU.

    python benchmarks/host_plan_bench.py

Prints the median of 30 steps of each kind, in milliseconds.
"""

from __future__ import annotations

import statistics
import time

import torch

from trio_llm.actors.messages import NewRequestData, ScheduledBatch, ScheduledRequest
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.testing import GREEDY

NUM_REQUESTS, BLOCK_SIZE, PROMPT_LEN, CHUNK_LEN = 256, 16, 16, 3969


def build() -> CudaModelExecutor:
    model = load_model(resolve_model("tiny"), dtype=torch.float32, device=torch.device("cpu"))
    executor = CudaModelExecutor(model, model_path=resolve_model("tiny"),
                                 num_kv_blocks=NUM_REQUESTS * 4 + 256, block_size=BLOCK_SIZE,
                                 max_model_len=4096)
    executor.start(CudaExecutorOptions(max_num_seqs=NUM_REQUESTS, use_cuda_graphs=False,
                                       use_fused_kernels=False))
    requests = [ScheduledRequest(request_id=f"r{index}", token_ids=[5] * PROMPT_LEN,
                                 input_from_previous_step=False, num_computed_tokens=0,
                                 new_block_ids=blocks, sample=True, output_index=0)
                for index, blocks in enumerate(block_ids())]
    executor.execute(ScheduledBatch(
        step_id=0, new_requests=[NewRequestData(request_id=f"r{index}", sampling=GREEDY)
                                 for index in range(NUM_REQUESTS)],
        requests=requests, finished_request_ids=[], num_tokens=PROMPT_LEN * NUM_REQUESTS))
    return executor


def block_ids() -> list[list[int]]:
    """Four blocks per request; the last request has room for the long chunk."""
    last = NUM_REQUESTS - 1
    return [list(range(4 * index, 4 * index + 4)) for index in range(last)] + [
        list(range(4 * last, 4 * last + 256))]


def step(mixed: bool) -> ScheduledBatch:
    rows = [ScheduledRequest(request_id=f"r{index}", token_ids=[],
                             input_from_previous_step=True, num_computed_tokens=PROMPT_LEN,
                             new_block_ids=[], sample=True, output_index=1)
            for index in range(NUM_REQUESTS - 1)]
    last = f"r{NUM_REQUESTS - 1}"
    rows.append(ScheduledRequest(request_id=last, token_ids=[7] * CHUNK_LEN,
                                 input_from_previous_step=False,
                                 num_computed_tokens=PROMPT_LEN, new_block_ids=[], sample=False,
                                 output_index=0) if mixed else
                ScheduledRequest(request_id=last, token_ids=[], input_from_previous_step=True,
                                 num_computed_tokens=PROMPT_LEN, new_block_ids=[], sample=True,
                                 output_index=1))
    return ScheduledBatch(step_id=1, new_requests=[], requests=rows, finished_request_ids=[],
                          num_tokens=0)


def host_seconds(executor: CudaModelExecutor, batch: ScheduledBatch) -> float:
    started = time.perf_counter()
    executor._update_states(batch)
    host_step = executor._plan(batch)
    executor._pack(host_step, executor._sampling_plan(host_step), executor.slots[0])
    return time.perf_counter() - started


def main() -> None:
    torch.set_num_threads(1)
    executor = build()
    for name, mixed in (("decode", False), ("mixed", True)):
        times = [host_seconds(executor, step(mixed)) for _ in range(30)]
        print(f"{name}: median {1000 * statistics.median(times):.2f} ms")


if __name__ == "__main__":
    main()
