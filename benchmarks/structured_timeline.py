"""Where a constrained step's time goes at depth 2: a timeline of the host side on the CPU.

    python benchmarks/structured_timeline.py [--num-prompts 256] [--forward-ms 5.2]
        [--sample-ms 0.15] [--launch-ms 1.0] [--max-output-len 300] [--unconstrained]

``gpu_bench.py structured``'s workload (every fourth request constrained by its JSON
schema, depth 2, the built-in qwen3-0.6b's 151,936-id vocabulary, so the masks and
the matchers are real-sized) through the whole engine, over a stand-in for the
pipelined CUDA executor that simulates the device's timeline: a step's forward pass
starts when it is launched and the compute stream is free, takes ``--forward-ms``;
its sampling starts when the forward pass is done and (for a step whose masks follow)
its masks are supplied, takes ``--sample-ms``; the step is done then. ``launch``
spends ``--launch-ms`` of host time (a spin that holds the GIL and lets go of it
every 0.1 ms, as a torch call would), ``supply_bitmasks`` does the CUDA executor's
own host work on the masks (gpu/cuda_executor.stage_token_bitmasks, on plain
memory), ``collect`` returns for each row a token its mask allows (a few probes into
the mask's bits).

Every host phase of the engine is timed (the scheduler's reconcile, mask fill and
planning, the runner's launch, supply and collect) and printed for the steady state
(full-batch steps): when each phase starts and ends, in ms after the device
finished sampling the step before (t0), medians over the steps, after the run's
output tok/s, ms per step and the simulated device's busy share. Output lengths are
cut to ``--max-output-len`` (gpu_bench's go to 1024) to keep a CPU run short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import trio

from trio_llm.actors import scheduler as scheduler_module
from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import ScheduledBatch, StepResult, StructuredOutputsParams
from trio_llm.api.bench import random_workload, run_engine_throughput
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import stage_token_bitmasks

sys.path.insert(0, str(Path(__file__).parent))
from structured_control_plane import sampled_result  # noqa: E402

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"},
                                           "count": {"type": "integer"}},
          "required": ["text", "count"]}

# step id -> phase -> (start, end) in perf_counter seconds
TIMES: dict[int, dict[str, tuple[float, float]]] = defaultdict(dict)
NUM_ROWS: dict[int, int] = {}  # step id -> its requests


def spin(seconds: float) -> None:
    """Host work: Python holding the GIL, released every 0.1 ms as a torch call does."""
    until = time.perf_counter() + seconds
    while (now := time.perf_counter()) < until:
        chunk = min(now + 1e-4, until)
        while time.perf_counter() < chunk:
            pass
        time.sleep(0)


def allowed_token(mask: bytes | None, vocab_size: int, key: int) -> int:
    """A token ``mask`` allows (any for None), from ``key``: probes, then the first."""
    for probe in range(64):
        token_id = (key * 2654435761 + probe * 40503) % vocab_size
        if mask is None or mask[token_id >> 3] >> (token_id & 7) & 1:
            return token_id
    return next(token_id for token_id in range(vocab_size)
                if mask[token_id >> 3] >> (token_id & 7) & 1)


class SimulatedStep:
    def __init__(self, batch: ScheduledBatch, forward_end: float) -> None:
        self.batch, self.forward_end = batch, forward_end
        self.done_at = float("inf")
        self.bitmasks: list[bytes] = []

    def is_ready(self) -> bool:
        return time.perf_counter() >= self.done_at

    def wait(self) -> None:
        time.sleep(max(0.0, self.done_at - time.perf_counter()))  # a blocking-sync event


class SimulatedDeviceExecutor:
    """launch / supply_bitmasks / collect as the CUDA executor offers them, over a
    simulated device; no model."""

    def __init__(self, model_path: Path, vocab_size: int, args: argparse.Namespace) -> None:
        self.model_path, self.vocab_size = model_path, vocab_size
        self.num_kv_blocks, self.max_model_len = 40000, 4096
        self.forward_seconds = args.forward_ms / 1000
        self.sample_seconds = args.sample_ms / 1000
        self.launch_seconds = args.launch_ms / 1000
        self._device_free = 0.0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        raise AssertionError("the runner drives launch and collect")

    def launch(self, batch: ScheduledBatch) -> SimulatedStep:
        started = time.perf_counter()
        spin(self.launch_seconds)
        enqueued = time.perf_counter()
        forward_start = max(enqueued, self._device_free)
        pending = SimulatedStep(batch, forward_start + self.forward_seconds)
        times = TIMES[batch.step_id]
        NUM_ROWS[batch.step_id] = len(batch.requests)
        times["launch"] = (started, enqueued)
        times["device forward"] = (forward_start, pending.forward_end)
        if not any(scheduled.bitmask_follows for scheduled in batch.requests):
            self._sample(pending, enqueued)
        return pending

    def supply_bitmasks(self, pending: SimulatedStep, token_bitmasks: list[bytes]) -> None:
        started = time.perf_counter()
        stage_token_bitmasks(token_bitmasks, row_indices=list(range(len(token_bitmasks))),
                             pin_memory=False)
        pending.bitmasks = token_bitmasks
        enqueued = time.perf_counter()
        TIMES[pending.batch.step_id]["supply"] = (started, enqueued)
        self._sample(pending, enqueued)

    def _sample(self, pending: SimulatedStep, enqueued: float) -> None:
        sample_start = max(enqueued, pending.forward_end)
        pending.done_at = self._device_free = sample_start + self.sample_seconds
        TIMES[pending.batch.step_id]["device sample"] = (sample_start, pending.done_at)

    def collect(self, pending: SimulatedStep) -> StepResult:
        started = time.perf_counter()
        result = sampled_result(pending.batch, pending.bitmasks, lambda mask, key: (
            allowed_token(mask, self.vocab_size, key & 0xFFFFFFFF)))
        TIMES[pending.batch.step_id]["collect"] = (started, time.perf_counter())
        return result


def instrument() -> None:
    """Time the scheduler's reconcile, planning and mask fills, by step."""
    cls = scheduler_module.Scheduler
    on_step_result, schedule, ready = cls.on_step_result, cls.schedule, cls.ready_bitmasks
    fill = scheduler_module.fill_bitmasks
    filling: list[int] = []

    def timed_on_step_result(self: Any, result: StepResult) -> Any:
        started = time.perf_counter()
        try:
            return on_step_result(self, result)
        finally:
            TIMES[result.step_id]["reconcile"] = (started, time.perf_counter())

    def timed_schedule(self: Any, pulled: Any) -> Any:
        started = time.perf_counter()
        plan = schedule(self, pulled)
        if plan.batch is not None:
            TIMES[plan.batch.step_id]["plan"] = (started, time.perf_counter())
        return plan

    def recorded_ready(self: Any) -> Any:
        step = ready(self)
        if step is not None:
            filling.append(step[0])
        return step

    def timed_fill(grammars: Any) -> Any:
        step_id = filling.pop(0)
        started = time.perf_counter()
        try:
            return fill(grammars)
        finally:
            TIMES[step_id]["fill"] = (started, time.perf_counter())

    cls.on_step_result, cls.schedule = timed_on_step_result, timed_schedule  # type: ignore
    cls.ready_bitmasks = recorded_ready  # type: ignore[method-assign]
    scheduler_module.fill_bitmasks = timed_fill  # type: ignore[assignment]


def steady_state_timeline(num_rows_of: dict[int, int]) -> list[tuple[str, float, float]]:
    """(phase, start, end) in ms after t0, medians over the full-batch steps N+1 whose
    step N and N+2 exist; t0 is the end of step N's sampling on the device."""
    full = max(num_rows_of.values())
    relative: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for step_id, times in TIMES.items():
        before, after = TIMES.get(step_id - 1), TIMES.get(step_id + 1)
        if (num_rows_of.get(step_id) != full or before is None or after is None
                or "device sample" not in before or "launch" not in after):
            continue
        t0 = before["device sample"][1]
        phases = [(f"N: {name}", before.get(name)) for name in ("collect", "reconcile")]
        phases += [(f"N+1: {name}", times.get(name)) for name in (
            "fill", "supply", "device forward", "device sample")]
        phases += [(f"N+2: {name}", after.get(name)) for name in (
            "plan", "launch", "device forward")]
        for name, span in phases:
            if span is not None:
                relative[name].append((1000 * (span[0] - t0), 1000 * (span[1] - t0)))
    return [(name, statistics.median(s for s, _ in spans), statistics.median(e for _, e in spans))
            for name, spans in relative.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--forward-ms", type=float, default=5.2)
    parser.add_argument("--sample-ms", type=float, default=0.15)
    parser.add_argument("--launch-ms", type=float, default=1.0)
    parser.add_argument("--max-output-len", type=int, default=300)
    parser.add_argument("--unconstrained", action="store_true")
    args = parser.parse_args()
    model_path = resolve_model("qwen3-0.6b")
    vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    executor = SimulatedDeviceExecutor(model_path, vocab_size, args)
    config = EngineConfig(model=str(model_path), load_format="dummy", device="cpu")
    workload = random_workload(seed=0, num_prompts=args.num_prompts, prompt_len=(100, 1024),
                               output_len=(100, args.max_output_len), max_token_id=10000)
    constraint = StructuredOutputsParams(json=json.dumps(SCHEMA))
    constrained = {} if args.unconstrained else {
        index: constraint for index in range(0, args.num_prompts, 4)}
    warm_up = {index: constraint for index in range(0, 16, 4)}
    trio.run(lambda: run_engine_throughput(config, executor, workload[:16], temperature=0.6,
                                           executor_kind="model", progress=False,
                                           constraints=warm_up))
    instrument()
    TIMES.clear()
    NUM_ROWS.clear()
    result: dict[str, Any] = trio.run(lambda: run_engine_throughput(
        config, executor, workload, temperature=0.6, executor_kind="model", progress=False,
        constraints=constrained))
    busy = sum(end - start for times in TIMES.values()
               for name, (start, end) in times.items() if name.startswith("device"))
    print(f"{'constrained' if constrained else 'unconstrained'}: "
          f"{result['output_tokens_per_second']:.0f} tok/s, {result['num_steps']} steps, "
          f"{result['milliseconds_per_step']:.2f} ms/step, device busy "
          f"{busy / result['elapsed_seconds']:.3f}")
    print(f"{'phase':28s} {'start':>7s} {'end':>7s}  (ms after t0 = step N's sampling done)")
    for name, start, end in sorted(steady_state_timeline(NUM_ROWS), key=lambda row: row[1]):
        print(f"{name:28s} {start:7.2f} {end:7.2f}")


if __name__ == "__main__":
    main()
