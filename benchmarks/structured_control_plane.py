"""The structured benchmark's control plane on the CPU, at a GPU's pace.

    python benchmarks/structured_control_plane.py [--num-prompts 64] [--step-ms 10]

``gpu_bench.py structured``'s workload (the nano-vllm lengths, every fourth request
constrained by the same JSON schema, depth 2) through the whole engine, over a
stand-in for the pipelined CUDA executor: each step "runs" ``--step-ms`` after the
one before it, and samples for each constrained row a token its mask allows (a
seeded pick), for the others a fixed pseudo-random id. What is left is everything
the host does for a step: scheduler, masks, runner protocol (launch,
supply_bitmasks, collect), detokenizer. The vocabulary is the built-in
qwen3-0.6b's (151,936 ids), so the masks and xgrammar's view of the vocabulary are
real-sized. Runs constrained (xgrammar's compiler cold: the first constrained
request builds its view of the vocabulary), unconstrained, constrained again (warm);
prints output tok/s, steps and the median batch size of each.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import ScheduledBatch, StepResult, StructuredOutputsParams
from trio_llm.api.bench import random_workload, run_engine_throughput
from trio_llm.gpu.builtin import resolve_model

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"},
                                           "count": {"type": "integer"}},
          "required": ["text", "count"]}


def allowed_token(mask: bytes, vocab_size: int, key: int) -> int:
    """A token the mask allows, picked from ``key``: a few random probes, else all."""
    words = np.frombuffer(mask, dtype=np.uint32)
    rng = random.Random(key)
    for _ in range(64):
        token_id = rng.randrange(vocab_size)
        if (words[token_id >> 5] >> (token_id & 31)) & 1:
            return token_id
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])
    return int(allowed[rng.randrange(len(allowed))])


def sampled_result(batch: ScheduledBatch, bitmasks: list[bytes],
                   draw: Callable[[bytes | None, int], int]) -> StepResult:
    """A stand-in executor's StepResult: each sampled row's token from ``draw(mask,
    key)``, its mask inline or among the ``bitmasks`` that followed the batch, ``key``
    from the row's request and output index."""
    following = iter(bitmasks)
    request_ids, token_ids = [], []
    for scheduled in batch.requests:
        if not scheduled.sample:
            continue
        mask = next(following) if scheduled.bitmask_follows else scheduled.token_bitmask
        token_ids.append(draw(mask, hash((scheduled.request_id, scheduled.output_index))))
        request_ids.append(scheduled.request_id)
    return StepResult(step_id=batch.step_id, request_ids=request_ids,
                      sampled_token_ids=token_ids)


class PacedStep:
    def __init__(self, batch: ScheduledBatch, due: float) -> None:
        self.batch, self.due = batch, due
        self.bitmasks: list[bytes] = []

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.due

    def wait(self) -> None:
        time.sleep(max(0.0, self.due - time.perf_counter()))


class PacedExecutor:
    """launch / supply_bitmasks / collect as the CUDA executor offers them; no model."""

    def __init__(self, model_path: Path, vocab_size: int, step_seconds: float) -> None:
        self.model_path, self.vocab_size = model_path, vocab_size
        self.num_kv_blocks, self.max_model_len = 40000, 4096
        self.step_seconds = step_seconds
        self.batch_sizes: list[int] = []
        self._last_due = 0.0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        raise AssertionError("the runner drives launch and collect")

    def launch(self, batch: ScheduledBatch) -> PacedStep:
        self._last_due = max(time.perf_counter(), self._last_due) + self.step_seconds
        self.batch_sizes.append(len(batch.requests))
        return PacedStep(batch, self._last_due)

    def supply_bitmasks(self, pending: PacedStep, token_bitmasks: list[bytes]) -> None:
        pending.bitmasks = token_bitmasks

    def collect(self, pending: PacedStep) -> StepResult:
        return sampled_result(pending.batch, pending.bitmasks, lambda mask, key: (
            100 + key % 9000 if mask is None else allowed_token(mask, self.vocab_size, key)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=10.0)
    args = parser.parse_args()
    model_path = resolve_model("qwen3-0.6b")
    vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    executor = PacedExecutor(model_path, vocab_size, args.step_ms / 1000)
    config = EngineConfig(model=str(model_path), load_format="dummy", device="cpu")
    workload = random_workload(seed=0, num_prompts=args.num_prompts, prompt_len=(100, 1024),
                               output_len=(100, 1024), max_token_id=10000)
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA))
    constrained = {index: constraint for index in range(0, args.num_prompts, 4)}
    for name, constraints in (("constrained, compiler cold", constrained),
                              ("unconstrained", {}), ("constrained, warm", constrained)):
        executor.batch_sizes.clear()
        result: dict[str, Any] = trio.run(lambda constraints=constraints: run_engine_throughput(
            config, executor, workload, temperature=0.6, executor_kind="model", progress=False,
            constraints=constraints))
        print(f"{name}: {result['output_tokens_per_second']:.0f} tok/s, "
              f"{result['num_steps']} steps, {result['milliseconds_per_step']:.2f} ms/step, "
              f"median batch {statistics.median(executor.batch_sizes):.0f} rows", flush=True)


if __name__ == "__main__":
    main()
