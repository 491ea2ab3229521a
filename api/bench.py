"""`trio-llm bench throughput`: the in-process engine on a random workload.

The default workload is the one nano-vllm publishes: 256 requests, prompt and
output lengths uniform in [100, 1024], prompt token ids uniform in [0, 10000),
ignore_eos, temperature 0.6. ``--executor null`` swaps the model for one that
returns tokens at once, which leaves the engine's own control plane
(scheduler, messages, detokenizer, streams) as the whole cost of a step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.executors import PipelinedExecutor
from trio_llm.actors.messages import (
    SamplingParams,
    ScheduledBatch,
    StepResult,
    StructuredOutputsParams,
)


class WorkloadItem(msgspec.Struct, frozen=True):
    prompt_token_ids: list[int]
    max_tokens: int


def random_workload(*, seed: int, num_prompts: int, prompt_len: tuple[int, int],
                    output_len: tuple[int, int], max_token_id: int) -> list[WorkloadItem]:
    """Random prompts from a seed: the same list on every machine."""
    rng = random.Random(seed)
    return [
        WorkloadItem(
            prompt_token_ids=[rng.randrange(max_token_id) for _ in range(rng.randint(*prompt_len))],
            max_tokens=rng.randint(*output_len),
        )
        for _ in range(num_prompts)
    ]


class NullExecutor:
    """A model that costs nothing: samples token 1 for every request.

    It keeps the real executor's sizes, so the engine is configured exactly as
    it would be with the model.
    """

    def __init__(self, model: Any) -> None:
        self.model_path = model.model_path
        self.num_kv_blocks = model.num_kv_blocks
        self.num_state_slots = model.num_state_slots
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size
        self.execute_seconds = 0.0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        sampled = [request.request_id for request in batch.requests if request.sample]
        return StepResult(step_id=batch.step_id, request_ids=sampled,
                          sampled_token_ids=[1] * len(sampled))


class TimedExecutor:
    """Wraps an executor to add up the time it spends in `execute`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.model_path = inner.model_path
        self.num_kv_blocks = inner.num_kv_blocks
        self.num_state_slots = inner.num_state_slots
        self.max_model_len = inner.max_model_len
        self.vocab_size = inner.vocab_size
        self.execute_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        start = time.perf_counter()
        try:
            return self.inner.execute(batch)
        finally:
            self.execute_seconds += time.perf_counter() - start


class TimedPipelinedExecutor(TimedExecutor):
    """A TimedExecutor over a pipelined executor, its launch/collect interface declared
    here: the runner tells a pipelined executor by ``isinstance``, which on Python 3.12
    reads attributes statically and never reaches ``__getattr__``: without these the
    benchmark ran the CUDA executor at depth 1. Its steps are not timed (``execute`` is
    never called)."""

    def launch(self, batch: ScheduledBatch) -> Any:
        return self.inner.launch(batch)

    def supply_bitmasks(self, pending: Any, token_bitmasks: list[bytes]) -> None:
        self.inner.supply_bitmasks(pending, token_bitmasks)

    def collect(self, pending: Any) -> StepResult:
        return self.inner.collect(pending)


def timed(executor: Any) -> TimedExecutor:
    """``executor`` with its ``execute`` time added up, pipelined if it is."""
    if isinstance(executor, PipelinedExecutor):
        return TimedPipelinedExecutor(executor)
    return TimedExecutor(executor)


def progress_bar(**options: Any) -> Any:
    """A tqdm progress bar; `trio-llm bench` needs the ``bench`` extra for it."""
    try:
        from tqdm import tqdm
    except ImportError:
        raise SystemExit("trio-llm bench needs the bench extra: "
                         "pip install 'trio-llm[bench]'") from None
    return tqdm(**options)


async def run_engine_throughput(config: EngineConfig, model: Any, workload: list[WorkloadItem],
                                *, temperature: float, executor_kind: str,
                                progress: bool,
                                constraints: dict[int, StructuredOutputsParams] | None = None,
                                timeline: list[tuple[float, int]] | None = None,
                                ) -> dict[str, Any]:
    """Submit the whole workload at once to an engine over ``model`` (a
    ModelExecutor); return measured figures. ``constraints`` maps a request's index
    to its structured-outputs constraint (those requests end at EOS too: a grammar
    decides where its output ends). ``timeline`` collects (seconds from the start,
    output tokens) of every output as it comes (``--plot``)."""
    import trio

    from trio_llm.api.engine import Engine
    from trio_llm.api.warm_up import WarmUpPlan

    executor = NullExecutor(model) if executor_kind == "null" else timed(model)
    num_output_tokens = 0
    bar = progress_bar(total=sum(item.max_tokens for item in workload), disable=not progress,
                       unit="tok", file=sys.stderr)

    async def one(engine: Engine, index: int, item: WorkloadItem) -> None:
        nonlocal num_output_tokens
        constraint = (constraints or {}).get(index)
        params = SamplingParams(max_tokens=item.max_tokens, temperature=temperature,
                                ignore_eos=constraint is None, seed=index,
                                structured_outputs=constraint)
        async for output in engine.generate(item.prompt_token_ids, params):
            num_output_tokens += len(output.token_ids)
            bar.update(len(output.token_ids))
            if timeline is not None:
                timeline.append((time.perf_counter() - start, len(output.token_ids)))

    with bar:  # closed however the run ends (a Ctrl-C too), before anything is printed
        async with Engine.open(config, executor=executor, warm_up=WarmUpPlan()) as engine:
            # timed from a warm engine, as a server's traffic is (api/warm_up.py)
            await engine.wait_ready()
            warm = engine.statistics()
            executor.execute_seconds = 0.0
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for index, item in enumerate(workload):
                    nursery.start_soon(one, engine, index, item)
            elapsed = time.perf_counter() - start
            stats = engine.statistics()
    num_steps = stats.num_steps - warm.num_steps
    return {
        "executor": executor_kind,
        "num_requests": len(workload),
        "num_prompt_tokens": sum(len(item.prompt_token_ids) for item in workload),
        "num_output_tokens": num_output_tokens,
        "elapsed_seconds": elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "num_steps": num_steps,
        "num_preemptions": stats.num_preemptions - warm.num_preemptions,
        "milliseconds_per_step": 1000 * elapsed / max(num_steps, 1),
        "executor_milliseconds_per_step": 1000 * executor.execute_seconds / max(num_steps, 1),
    }


def run_throughput(args: argparse.Namespace, config: EngineConfig) -> int:
    """`trio-llm bench throughput` with its parsed flags and engine config."""
    import trio

    def workload(max_token_id: int) -> list[WorkloadItem]:
        return random_workload(seed=args.seed_workload, num_prompts=args.num_prompts,
                               prompt_len=(args.min_prompt_len, args.max_prompt_len),
                               output_len=(args.min_output_len, args.max_output_len),
                               max_token_id=max_token_id)

    timeline: list[tuple[float, int]] | None = [] if args.plot is not None else None
    if args.backend == "transformers":
        from trio_llm.gpu.cuda_hf_baseline import run_transformers_throughput

        result = run_transformers_throughput(config, workload(args.max_token_id),
                                             temperature=args.temperature)
    else:
        from trio_llm.gpu.factory import create_executor

        model = create_executor(config)
        try:
            items = workload(min(args.max_token_id, model.vocab_size))
            result = trio.run(lambda: run_engine_throughput(
                config, model, items, temperature=args.temperature,
                executor_kind=args.executor, progress=not args.no_progress,
                timeline=timeline))
        finally:
            close = getattr(model, "close", None)  # a tensor-parallel executor's workers
            if close is not None:
                close()
    result["config"] = msgspec.to_builtins(config)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        print(summary_table(result))
    if args.json not in (None, "-"):
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot is not None and timeline is not None:
        plot_throughput(args.plot, timeline, title=throughput_title(args, config, result))
    return 0


def throughput_title(args: argparse.Namespace, config: EngineConfig,
                     result: dict[str, Any]) -> str:
    return (f"trio-llm bench throughput: {config.model}, {args.num_prompts} requests, "
            f"{args.min_prompt_len}-{args.max_prompt_len} in, {args.min_output_len}-"
            f"{args.max_output_len} out, all at once, "
            f"{result['output_tokens_per_second']:,.0f} tok/s, {time.strftime('%Y-%m-%d')}")


# Bins of the throughput plot.
NUM_PLOT_BINS = 60


def plot_throughput(path: Path, timeline: list[tuple[float, int]], *, title: str) -> None:
    """One PNG: output tokens/s over the timed run."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("trio-llm bench throughput: --plot needs matplotlib, which is not "
                         "installed (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    end = max((moment for moment, _ in timeline), default=0.0)
    width = max(end / NUM_PLOT_BINS, 1e-3)
    tokens = [0] * NUM_PLOT_BINS
    for moment, count in timeline:
        tokens[min(int(moment / width), NUM_PLOT_BINS - 1)] += count
    figure, axis = pyplot.subplots(figsize=(11, 5))
    axis.plot([index * width for index in range(NUM_PLOT_BINS)],
              [count / width for count in tokens])
    axis.set_xlabel("seconds from the start (after the warm-up)")
    axis.set_ylabel("output tokens/s")
    axis.set_ylim(bottom=0)
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def summary_table(result: dict[str, Any]) -> str:
    """The figures of a throughput run, one per line, aligned (config left to --json)."""
    rows = [(key.replace("_", " "), value) for key, value in result.items() if key != "config"]
    width = max(len(name) for name, _ in rows)
    lines = ["trio-llm bench throughput", "-" * (width + 16)]
    for name, value in rows:
        shown = f"{value:,.2f}" if isinstance(value, float) else f"{value:,}" \
            if isinstance(value, int) else str(value)
        lines.append(f"{name:<{width}}  {shown:>14}")
    return "\n".join(lines)
