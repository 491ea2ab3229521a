"""The host's whole launch and collect of a step, without a device: the pipelined
executor on the CPU with graphs "captured" (run eagerly on their padded static
buffers) and the model's forward replaced by a constant, so what is timed is
planning, packing, the upload, the graph-input copies, the previous-token gather,
sampling and the download: every host call of a step but the model's kernels.

    python benchmarks/host_launch_bench.py [--profile] [--device cuda]

Three kinds of step over 256 requests: decode-only (256 decode rows), mixed
(255 decode rows and a 3,969-token chunk) and prefill-only (two 2,048-token
prompts); depth 2 (two steps in flight). Prints the median and the best of 40 steps
of each kind in milliseconds (on a shared machine the best is the steadier figure);
``--profile`` prints cProfile's top functions of the mixed and decode runs. On the
CPU torch's calls cost less than a CUDA launch, so these figures are a lower bound of
the H200's, to compare code, not machines.

``--device cuda`` runs the same steps on the GPU with the tiny model itself (bf16,
graphs captured, fused kernels; its device time is a fraction of the host's), so
that what it prints is the host's launch with real CUDA calls: per kind, the median
launch time and its planning, packing and waiting shares (ExecutorStatistics), and
with ``--profile`` where the rest goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from trio_llm.actors.messages import NewRequestData, ScheduledBatch, ScheduledRequest
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import (
    CudaExecutorOptions,
    CudaModelExecutor,
    ExecutorStatistics,
)
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.testing import GREEDY

NUM_REQUESTS, BLOCK_SIZE, PROMPT_LEN, CHUNK_LEN, PREFILL_LEN = 256, 16, 16, 3969, 2048
MAX_MODEL_LEN = 8192


class ConstantForward:
    """The model's forward and logits at no cost: hidden states of zeros, and logits
    over a vocabulary of 8 (greedy rows only: sampling over the tiny model's whole
    vocabulary on the CPU would be device work)."""

    def __init__(self) -> None:
        self._logits = torch.zeros((NUM_REQUESTS + 1, 8))

    def __call__(self, token_ids, positions, kv_caches, metadata):  # noqa: ANN001
        return torch.zeros((token_ids.shape[0], 1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits[:hidden.shape[0]]


def build(device: torch.device) -> CudaModelExecutor:
    on_cuda = device.type == "cuda"
    model = load_model(resolve_model("tiny"), dtype=torch.bfloat16 if on_cuda else torch.float32,
                       device=device)
    num_blocks = NUM_REQUESTS * (MAX_MODEL_LEN // BLOCK_SIZE)
    executor = CudaModelExecutor(model, model_path=resolve_model("tiny"),
                                 num_kv_blocks=num_blocks, block_size=BLOCK_SIZE,
                                 max_model_len=MAX_MODEL_LEN)
    executor.start(CudaExecutorOptions(max_num_seqs=NUM_REQUESTS, use_cuda_graphs=True,
                                       use_fused_kernels=on_cuda))
    if on_cuda:
        return executor
    constant = ConstantForward()
    for graphs in (executor.decode_graphs, executor.varlen_graphs):
        graphs._model = constant  # type: ignore[assignment]
    return executor


class Workload:
    """Requests that decode for ever, each with its own blocks; a long one for chunks."""

    def __init__(self, executor: CudaModelExecutor) -> None:
        self.executor = executor
        self.step_id = 0
        self.computed = {f"r{index}": 0 for index in range(NUM_REQUESTS)}
        self.blocks = {request_id: list(range(index * (MAX_MODEL_LEN // BLOCK_SIZE),
                                              (index + 1) * (MAX_MODEL_LEN // BLOCK_SIZE)))
                       for index, request_id in enumerate(self.computed)}
        self.num_blocks = dict.fromkeys(self.computed, 0)
        prompts = [self._chunk(request_id, PROMPT_LEN, sample=True)
                   for request_id in self.computed]
        new = [NewRequestData(request_id=request_id, sampling=GREEDY)
               for request_id in self.computed]
        executor.execute(self._batch(prompts, new))

    def _new_blocks(self, request_id: str, context_len: int) -> list[int]:
        needed = -(-context_len // BLOCK_SIZE)
        have = self.num_blocks[request_id]
        self.num_blocks[request_id] = max(have, needed)
        return self.blocks[request_id][have:needed]

    def _chunk(self, request_id: str, num_tokens: int, *, sample: bool) -> ScheduledRequest:
        start = self.computed[request_id]
        self.computed[request_id] = start + num_tokens
        return ScheduledRequest(request_id=request_id, token_ids=[5] * num_tokens,
                                input_from_previous_step=False, num_computed_tokens=start,
                                new_block_ids=self._new_blocks(request_id, start + num_tokens),
                                sample=sample, output_index=0)

    def _decode(self, request_id: str) -> ScheduledRequest:
        start = self.computed[request_id]
        self.computed[request_id] = start + 1
        return ScheduledRequest(request_id=request_id, token_ids=[],
                                input_from_previous_step=True, num_computed_tokens=start,
                                new_block_ids=self._new_blocks(request_id, start + 1),
                                sample=True, output_index=1)

    def _batch(self, requests: list[ScheduledRequest],
               new: list[NewRequestData] | None = None) -> ScheduledBatch:
        self.step_id += 1
        return ScheduledBatch(step_id=self.step_id, new_requests=new or [], requests=requests,
                              finished_request_ids=[],
                              num_tokens=sum(len(r.token_ids) or 1 for r in requests))

    def step(self, kind: str) -> ScheduledBatch:
        ids = list(self.computed)
        if kind == "decode":
            return self._batch([self._decode(request_id) for request_id in ids])
        if kind == "mixed":
            self._restart(ids[-1])
            return self._batch([self._decode(request_id) for request_id in ids[:-1]]
                               + [self._chunk(ids[-1], CHUNK_LEN, sample=False)])
        for request_id in ids[-2:]:
            self._restart(request_id)
        return self._batch([self._chunk(request_id, PREFILL_LEN, sample=True)
                            for request_id in ids[-2:]])

    def _restart(self, request_id: str) -> None:
        """A long request's chunk reuses its blocks from position PROMPT_LEN on."""
        self.computed[request_id] = PROMPT_LEN  # (the blocks it has stay its own)


def run(executor: CudaModelExecutor, workload: Workload, kind: str, num_steps: int
        ) -> list[float]:
    """Host seconds of launch + collect per step, two steps in flight."""
    times, in_flight = [], []
    for _ in range(num_steps):
        batch = workload.step(kind)
        started = time.perf_counter()
        in_flight.append(executor.launch(batch))
        if len(in_flight) == 2:
            executor.collect(in_flight.pop(0))
        times.append(time.perf_counter() - started)
    for pending in in_flight:
        executor.collect(pending)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    executor = build(torch.device(args.device))
    workload = Workload(executor)
    for kind in ("decode", "mixed", "prefill"):
        run(executor, workload, kind, 5)  # warm-up
        if args.profile and kind != "prefill":
            profiler = cProfile.Profile()
            profiler.runcall(run, executor, workload, kind, 40)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        executor.stats = ExecutorStatistics()
        times = run(executor, workload, kind, 40)
        stats = executor.stats
        shares = {name: 1000 * getattr(stats, f"{name}_seconds_by_kind")[kind] / len(times)
                  for name in ("launch", "plan", "pack", "launch_wait")}
        print(f"{kind}: median {1000 * statistics.median(times):.2f} ms, best "
              f"{1000 * min(times):.2f} ms ({stats.num_graph_steps_by_kind[kind]} graph "
              f"steps); launch per step " + ", ".join(f"{name} {ms:.3f}"
                                                       for name, ms in shares.items()))


if __name__ == "__main__":
    main()
