"""The control plane per step with prefix caching on and off, side by side.

Workload (a) of `trio-llm bench throughput` (256 requests, prompts and outputs 100 to
1,024 tokens) on the null executor, so the engine's own work is the whole step. Runs
alternate on and off, so a busy machine slows both alike. Per run: wall milliseconds
per step, process CPU milliseconds per step, and the scheduler's own CPU time
(``Scheduler.schedule`` and ``on_step_result``, thread CPU time) per step; then the
medians, and the median change of each on run against the off run after it.

    OMP_NUM_THREADS=1 python benchmarks/control_plane_ab.py --runs 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.scheduler import Scheduler
from trio_llm.api.bench import random_workload, run_engine_throughput
from trio_llm.gpu.executor import ModelExecutor


class SchedulerClock:
    """Adds up the thread CPU time spent in the scheduler's two per-step calls."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = (Scheduler.schedule, Scheduler.on_step_result)

    def install(self) -> None:
        schedule, on_step_result = self._originals

        def timed(method: Any) -> Any:
            def wrapper(scheduler: Scheduler, *args: Any) -> Any:
                started = time.thread_time()
                try:
                    return method(scheduler, *args)
                finally:
                    self.seconds += time.thread_time() - started
            return wrapper

        Scheduler.schedule = timed(schedule)  # type: ignore[method-assign]
        Scheduler.on_step_result = timed(on_step_result)  # type: ignore[method-assign]


def measure(config: EngineConfig, model: ModelExecutor, items: list[Any],
            clock: SchedulerClock) -> dict[str, float]:
    clock.seconds = 0.0
    cpu_started = time.process_time()
    result = trio.run(lambda: run_engine_throughput(config, model, items, temperature=0.6,
                                                    executor_kind="null", progress=False))
    cpu_seconds = time.process_time() - cpu_started
    num_steps = max(result["num_steps"], 1)
    return {"wall_ms_per_step": result["milliseconds_per_step"],
            "cpu_ms_per_step": 1000 * cpu_seconds / num_steps,
            "scheduler_ms_per_step": 1000 * clock.seconds / num_steps,
            "num_steps": result["num_steps"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-kv-blocks", type=int, default=40000)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device="cpu", num_kv_blocks=args.num_kv_blocks)
    model = ModelExecutor.create(config)
    items = random_workload(seed=0, num_prompts=256, prompt_len=(100, 1024),
                            output_len=(100, 1024), max_token_id=min(10000, model.vocab_size))
    clock = SchedulerClock()
    clock.install()
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for index in range(args.runs):
        for enabled in (True, False):
            figures = measure(replace(config, enable_prefix_caching=enabled), model, items,
                              clock)
            runs[enabled].append(figures)
            print(f"run {index} caching {'on ' if enabled else 'off'} "
                  + " ".join(f"{name} {value:.3f}" for name, value in figures.items()),
                  flush=True)
    for name in ("wall_ms_per_step", "cpu_ms_per_step", "scheduler_ms_per_step"):
        on = statistics.median(run[name] for run in runs[True])
        off = statistics.median(run[name] for run in runs[False])
        # Each on run against the off run right after it: robust to the load drifting.
        paired = statistics.median(a[name] / b[name] - 1
                                   for a, b in zip(runs[True], runs[False], strict=True))
        print(f"median {name}: on {on:.3f}, off {off:.3f}, change {100 * (on / off - 1):+.1f}%;"
              f" median paired change {100 * paired:+.1f}%")


if __name__ == "__main__":
    main()
