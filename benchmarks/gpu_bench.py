"""GPU benchmarks of the issue's workloads; each writes JSON under $OUT.

    python3 benchmarks/gpu_bench.py decode --model qwen3-0.6b      # (b) and (c)
    python3 benchmarks/gpu_bench.py throughput --model qwen3-0.6b  # (a), (c) and the profile
    python3 benchmarks/gpu_bench.py transformers --model qwen3-0.6b --time-limit 150  # (e)
    python3 benchmarks/gpu_bench.py structured --model qwen3-0.6b  # structured outputs cost

decode: one request, a 128-token prompt, 256 new tokens (greedy, ignore_eos),
through the whole engine at depth 1 and depth 2, and through the executor
alone (its launch/collect loop, no scheduler): milliseconds per output token
over the decode steps, prefill excluded. Also the device time of one decode
step's graph replay alone (CUDA events, median), the floor of the other figures.

    python3 benchmarks/gpu_bench.py mixed --model qwen3-0.6b       # 2000 x (128 in, 64..192 out)
    python3 benchmarks/gpu_bench.py long --model qwen3-0.6b        # one 32,000-token prompt
    python3 benchmarks/gpu_bench.py context --model qwen3.5-35b-a3b  # decode at 1k..128k

throughput: the nano-vllm workload (256 requests, seed 0, prompt and output
lengths uniform in [100, 1024], prompt ids in [0, 10000), ignore_eos,
temperature 0.6) through the engine, depth 2 then depth 1, after an untimed
warm-up of 64 short requests; output tokens/s, with the share of wall time the
device computes, the CPU time per step, and the host's launch time per kind of
step (decode-only, mixed, prefill-only).

mixed: the same measurement on 2000 requests of 128 prompt tokens and 64 to 192
output tokens (seed 0, temperature 0.6), where nearly every step mixes prefills
and decodes.

long: one request of a 32,000-token prompt and 256 new tokens (greedy), through
the engine at depth 2 and 1: time to the first token (the chunked prefill) and
milliseconds per output token over the decode steps.

structured: the throughput workload at depth 2 (``--num-prompts`` 256, all at once),
first unconstrained, then with every fourth request (64 of 256) constrained by a
JSON schema (an object with a free string field: random weights run it to max_tokens);
output tokens/s of both and their ratio. xgrammar's view of the vocabulary and the
grammar are built first (timed), then an untimed constrained warm-up runs.
``--rounds N`` runs the two arms N times, interleaved, and adds the ratio over all
rounds (tokens over seconds).
context: single-stream decode through the executor alone at depth 2 (128 new
tokens) after prompts of 1k, 8k, 32k and 128k tokens (``--contexts``), prefilled in
chunks of max_num_batched_tokens: ms per token at each, and its ratio to the first.

Every phase prints its figures as it ends; a phase stuck for ``--stall-seconds``
dumps every thread's stack.

FP8 (issue 27): ``--quantization fp8`` gives the dummy weights in e4m3 with per-row
scales (kept FP8 on the GPU: the FP8 GEMMs), ``--kv-cache-dtype fp8`` the FP8 KV cache;
the JSON's name then carries ``-fp8`` / ``-fp8kv``. ``decode --engine-only`` measures only
the three engine runs at depth 2 (the issue's single-stream figure), to fit a bf16/FP8
pair in one device call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
from cuda_timing import event_times_ms

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import (
    NewRequestData,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
)
from trio_llm.gpu.cuda_executor import STEP_KINDS, CudaModelExecutor
from trio_llm.gpu.testing import GREEDY

OUT = Path(os.environ.get("OUT", "."))
# --tensor-parallel-size (decode, throughput): ranks in worker processes, one GPU each.
# Figures that read the executor's own statistics or graphs are left out then.
TENSOR_PARALLEL_SIZE = 1
# --quantization, --kv-cache-dtype: every engine of the run (FP8 weights, FP8 KV cache)
PRECISION: dict[str, Any] = {}
PROMPT_LEN, NUM_NEW_TOKENS = 128, 256
# BENCH_DEVICE=cpu runs the same code on the CPU (a smoke test of the script, not a figure)
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"


def engine_config(model: str, *, depth: int, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = {"model": model, "load_format": "dummy", "dtype": DTYPE,
                              "device": DEVICE, "pipeline_depth": depth,
                              "tensor_parallel_size": TENSOR_PARALLEL_SIZE, **PRECISION}
    fields.update(overrides)
    return EngineConfig(**fields)


def create_executor(config: EngineConfig, *, measure_device_time: bool = False
                    ) -> CudaModelExecutor:
    started = time.perf_counter()
    if config.tensor_parallel_size > 1:
        # the ranks' own executors are CudaModelExecutors; this one only drives them
        from trio_llm.gpu.tp_executor import TensorParallelExecutor

        executor: Any = TensorParallelExecutor.create(config)
        print(f"{config.tensor_parallel_size} ranks for {config.model} ready in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        return cast(CudaModelExecutor, executor)
    executor = CudaModelExecutor.create(config)
    if measure_device_time:
        executor.options = dataclasses.replace(executor.options, measure_device_time=True)
    print(f"executor for {config.model} ready in {time.perf_counter() - started:.1f} s",
          flush=True)
    return executor


# -- (b) single-stream decode ----------------------------------------------------------


async def engine_decode_ms_per_token(config: EngineConfig, executor: CudaModelExecutor) -> float:
    """Wall time between the first and the last output token, over the tokens between."""
    from trio_llm.api.engine import Engine

    prompt = [(7 * i) % 9000 + 100 for i in range(PROMPT_LEN)]
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    _drain(executor)
    async with Engine.open(config, executor=executor) as engine:
        for _ in range(2):  # the first run warms up; the second is timed
            times, num_tokens = [], 0
            async for output in engine.generate(prompt, params):
                times.append(time.perf_counter())
                num_tokens += len(output.token_ids)
    assert num_tokens == NUM_NEW_TOKENS
    return 1000 * (times[-1] - times[0]) / (num_tokens - 1)


def executor_decode_ms_per_token(executor: CudaModelExecutor, *, depth: int,
                                 request_id: str, prompt_len: int = PROMPT_LEN,
                                 num_new_tokens: int = NUM_NEW_TOKENS) -> float:
    """The executor alone: a prefill (in chunks of max_num_batched_tokens), then decode
    steps launched ``depth`` deep. A model with linear-attention layers runs the
    request in state slot 0 (each run's request has finished before the next starts)."""
    block_size = executor.block_size
    num_blocks = -(-(prompt_len + num_new_tokens + 1) // block_size)
    state_slot = 0 if getattr(executor, "num_state_slots", 0) else None
    chunk_len = executor.options.max_num_batched_tokens if isinstance(
        executor, CudaModelExecutor) else prompt_len
    new_requests = [NewRequestData(request_id=request_id, sampling=GREEDY,
                                   state_slot=state_slot)]
    for start in range(0, prompt_len, chunk_len):
        end = min(start + chunk_len, prompt_len)
        prefill = ScheduledBatch(
            step_id=0, new_requests=new_requests,
            requests=[ScheduledRequest(request_id=request_id,
                                       token_ids=[(7 * i) % 9000 + 100 for i in range(start, end)],
                                       input_from_previous_step=False, num_computed_tokens=start,
                                       new_block_ids=list(range(num_blocks)) if start == 0 else [],
                                       sample=end == prompt_len, output_index=0)],
            finished_request_ids=[], num_tokens=end - start)
        executor.collect(executor.launch(prefill))
        new_requests = []

    def decode(step: int) -> ScheduledBatch:
        return ScheduledBatch(step_id=step, new_requests=[], requests=[ScheduledRequest(
            request_id=request_id, token_ids=[], input_from_previous_step=True,
            num_computed_tokens=prompt_len + step - 1, new_block_ids=[], sample=True,
            output_index=step)], finished_request_ids=[], num_tokens=1)

    started = time.perf_counter()
    in_flight = []
    for step in range(1, num_new_tokens):
        in_flight.append(executor.launch(decode(step)))
        if len(in_flight) == depth:
            executor.collect(in_flight.pop(0))
    for pending in in_flight:
        executor.collect(pending)
    elapsed = time.perf_counter() - started
    finish = ScheduledBatch(step_id=num_new_tokens, new_requests=[], requests=[],
                            finished_request_ids=[request_id], num_tokens=0)
    executor.collect(executor.launch(finish))
    return 1000 * elapsed / (num_new_tokens - 1)


# context: single-stream decode after prompts of these lengths (the hybrid family's
# linear-attention layers keep a state of fixed size; only its full-attention layers
# read the whole context)
CONTEXT_LENGTHS = (1024, 8192, 32768, 131072)
CONTEXT_NEW_TOKENS = 128


def run_context(args: argparse.Namespace) -> dict[str, Any]:
    """Decode ms per token through the executor alone at depth 2, after a prompt of each
    of CONTEXT_LENGTHS tokens (prefilled in chunks), and the ratios to the shortest."""
    contexts = args.contexts or list(CONTEXT_LENGTHS)
    results: dict[str, Any] = {"model": args.model, "contexts": contexts,
                               "num_new_tokens": CONTEXT_NEW_TOKENS}
    max_model_len = max(contexts) + CONTEXT_NEW_TOKENS + 64
    block_size = 16
    config = engine_config(args.model, depth=2, max_num_seqs=8, block_size=block_size,
                           num_kv_blocks=-(-max_model_len // block_size) + 16,
                           max_model_len=max_model_len, enable_prefix_caching=False)
    executor = create_executor(config)
    executor_decode_ms_per_token(executor, depth=2, request_id="warm", prompt_len=contexts[0],
                                 num_new_tokens=CONTEXT_NEW_TOKENS)
    for context in contexts:
        started = time.perf_counter()
        results[f"context_{context}_ms_per_token"] = executor_decode_ms_per_token(
            executor, depth=2, request_id=f"context-{context}", prompt_len=context,
            num_new_tokens=CONTEXT_NEW_TOKENS)
        results[f"context_{context}_run_seconds"] = time.perf_counter() - started
        results[f"context_{context}_over_{contexts[0]}"] = (
            results[f"context_{context}_ms_per_token"]
            / results[f"context_{contexts[0]}_ms_per_token"])
        print(json.dumps({key: value for key, value in results.items()
                          if key.startswith(f"context_{context}_")}), flush=True)
    return results


def _drain(executor: CudaModelExecutor) -> None:
    """Collect what an earlier run left in flight (a tensor-parallel executor's steps
    are all collected by then)."""
    if isinstance(executor, CudaModelExecutor):
        executor.drain()


def graph_replay_ms(executor: CudaModelExecutor, batch_size: int = 1) -> float | None:
    """Median device time of one captured decode step's replay, logits included (its
    inputs as they are: replaying rewrites the KV slot they name, the last step's, with
    the same values)."""
    if not isinstance(executor, CudaModelExecutor):
        return None  # the graphs live in the ranks' processes
    captured = executor.graphs.get(batch_size)
    stream = executor.compute.torch_stream
    if captured is None or stream is None:
        return None
    with torch.cuda.stream(stream):
        times = event_times_ms(captured.graph.replay, 50)
    return statistics.median(times[5:])


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    results: dict[str, Any] = {"model": args.model, "prompt_len": PROMPT_LEN,
                               "num_new_tokens": NUM_NEW_TOKENS}
    config = engine_config(args.model, depth=2, max_num_seqs=8, num_kv_blocks=1024,
                           max_model_len=4096)
    executor = create_executor(config)
    if args.engine_only:
        results["engine_depth_2_ms_per_token_runs"] = [
            trio.run(engine_decode_ms_per_token, config, executor) for _ in range(3)]
        results["engine_depth_2_ms_per_token"] = statistics.median(
            results["engine_depth_2_ms_per_token_runs"])
        return results
    results["graph_replay_ms_batch_1"] = graph_replay_ms(executor)
    for depth in (1, 2):
        results[f"executor_depth_{depth}_ms_per_token"] = executor_decode_ms_per_token(
            executor, depth=depth, request_id=f"warm-{depth}")
        results[f"executor_depth_{depth}_ms_per_token"] = executor_decode_ms_per_token(
            executor, depth=depth, request_id=f"timed-{depth}")
    # again, now that the graph's inputs are the last decode step's (its real context):
    # the first figure replays whatever the inputs held after start-up
    results["graph_replay_ms_batch_1_at_last_step"] = graph_replay_ms(executor)
    for depth in (1, 2):
        depth_config = engine_config(args.model, depth=depth, max_num_seqs=8, num_kv_blocks=1024,
                                     max_model_len=4096)
        results[f"engine_depth_{depth}_ms_per_token"] = trio.run(
            engine_decode_ms_per_token, depth_config, executor)
    # the target asks for three separate runs: two more engines at depth 2
    depth_2_config = engine_config(args.model, depth=2, max_num_seqs=8, num_kv_blocks=1024,
                                   max_model_len=4096)
    results["engine_depth_2_ms_per_token_runs"] = [
        results["engine_depth_2_ms_per_token"],
        *(trio.run(engine_decode_ms_per_token, depth_2_config, executor) for _ in range(2))]
    results.update(device_ms_per_decode_step(executor))
    return results


def device_ms_per_decode_step(executor: CudaModelExecutor) -> dict[str, float]:
    """The executor alone at depth 2 once more, with the compute stream's device time per
    step measured by events (graph replay plus what runs outside the graph: the input
    copies, the previous-token gather, sampling); after the timed runs, since the
    events cost a little."""
    executor.options = dataclasses.replace(executor.options, measure_device_time=True)
    before = _stats_snapshot(executor)
    ms_per_token = executor_decode_ms_per_token(executor, depth=2, request_id="device-time")
    after = _stats_snapshot(executor)
    executor.options = dataclasses.replace(executor.options, measure_device_time=False)
    num_steps = max(after["num_steps"] - before["num_steps"], 1)
    launch_ms = 1000 * (after["launch_seconds"] - before["launch_seconds"]) / num_steps
    return {"device_time_run_ms_per_token": ms_per_token,
            "device_compute_ms_per_step": 1000 * (after["device_compute_seconds"]
                                                  - before["device_compute_seconds"])
            / num_steps,
            "device_time_run_launch_host_ms_per_step": launch_ms}


# -- (a) throughput ------------------------------------------------------------------------


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    return _throughput(args, num_prompts=args.num_prompts or 256, prompt_len=(100, 1024),
                       output_len=(100, 1024))


def run_mixed(args: argparse.Namespace) -> dict[str, Any]:
    return _throughput(args, num_prompts=args.num_prompts or 2000, prompt_len=(128, 128),
                       output_len=(64, 192))


def _throughput(args: argparse.Namespace, *, num_prompts: int, prompt_len: tuple[int, int],
                output_len: tuple[int, int]) -> dict[str, Any]:
    import trio

    from trio_llm.api.bench import random_workload, run_engine_throughput

    results: dict[str, Any] = {"model": args.model, "num_prompts": num_prompts,
                               "prompt_len": prompt_len, "output_len": output_len}
    started = time.perf_counter()
    executor = create_executor(engine_config(args.model, depth=2), measure_device_time=True)
    results["start_up_seconds"] = time.perf_counter() - started
    if isinstance(executor, CudaModelExecutor):
        results["graph_capture_seconds"] = executor.graph_capture_seconds
        results["graph_memory_gib"] = executor.graph_memory_bytes / 2**30
    workload = random_workload(seed=0, num_prompts=num_prompts, prompt_len=prompt_len,
                               output_len=output_len,
                               max_token_id=min(10000, executor.vocab_size))
    # Warm-up, untimed: the first uses of kernels (CUDA loads their modules lazily, and
    # a load waits for the device) and of the allocator's block sizes come here, not in
    # whichever depth runs first.
    warm_up = random_workload(seed=1, num_prompts=64, prompt_len=(100, 1024),
                              output_len=(16, 64), max_token_id=min(10000, executor.vocab_size))
    trio.run(lambda: run_engine_throughput(engine_config(args.model, depth=2), executor, warm_up,
                                           temperature=0.6, executor_kind="model",
                                           progress=False))
    for depth in args.depths:
        config = engine_config(args.model, depth=depth)
        _drain(executor)
        stats_before = _stats_snapshot(executor)
        cpu_before = time.process_time()
        result = trio.run(lambda config=config: run_engine_throughput(
            config, executor, workload, temperature=0.6, executor_kind="model",
            progress=False))
        cpu_seconds = time.process_time() - cpu_before
        stats = {key: value - stats_before[key] for key, value in
                 _stats_snapshot(executor).items()}
        if stats:
            result.update(_profile(result, stats, cpu_seconds))
        results[f"depth_{depth}"] = result
        print(json.dumps({f"depth_{depth}": result}, indent=1), flush=True)
    return results


def run_structured(args: argparse.Namespace) -> dict[str, Any]:
    import faulthandler

    import trio

    from trio_llm.actors.grammar import Grammars, tokenizer_info
    from trio_llm.actors.messages import StructuredOutputsParams
    from trio_llm.actors.tokenizer import Tokenizer
    from trio_llm.api.bench import random_workload, run_engine_throughput

    schema = {"type": "object", "properties": {"text": {"type": "string"},
                                               "count": {"type": "integer"}},
              "required": ["text", "count"]}
    constraint = StructuredOutputsParams(json=json.dumps(schema))
    faulthandler.dump_traceback_later(args.stall_seconds)
    executor = create_executor(engine_config(args.model, depth=2), measure_device_time=True)
    results: dict[str, Any] = {"model": args.model, "schema": schema}
    tokenizer = Tokenizer.from_dir(executor.model_path)
    started = time.perf_counter()
    tokenizer_info(tokenizer, executor.vocab_size)
    results["tokenizer_info_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    Grammars(tokenizer, executor.vocab_size).compile(constraint)  # the process-wide compiler
    results["first_compile_seconds"] = time.perf_counter() - started
    print(json.dumps(results), flush=True)
    fills = _time_mask_fills()
    max_token_id = min(10000, executor.vocab_size)
    num_prompts = args.num_prompts or 256
    workload = random_workload(seed=0, num_prompts=num_prompts, prompt_len=(100, 1024),
                               output_len=(100, 1024), max_token_id=max_token_id)
    constrained = {index: constraint for index in range(0, num_prompts, 4)}
    warm_up = random_workload(seed=1, num_prompts=64, prompt_len=(100, 1024),
                              output_len=(16, 64), max_token_id=max_token_id)
    config = engine_config(args.model, depth=2)

    def run(name: str, items: list[Any], constraints: dict[int, Any]) -> dict[str, Any]:
        faulthandler.dump_traceback_later(args.stall_seconds)  # this phase's own clock
        executor.drain()
        fills.clear()
        stats_before = _stats_snapshot(executor)
        cpu_before = time.process_time()
        result = trio.run(lambda: run_engine_throughput(
            config, executor, items, temperature=0.6, executor_kind="model", progress=False,
            constraints=constraints))
        cpu_seconds = time.process_time() - cpu_before
        stats = {key: value - stats_before[key] for key, value in
                 _stats_snapshot(executor).items()}
        result.update(_profile(result, stats, cpu_seconds))
        if fills:
            result["mask_fills"] = {"num_steps": len(fills),
                                    "median_ms": 1000 * statistics.median(fills),
                                    "max_ms": 1000 * max(fills), "total_seconds": sum(fills)}
        print(json.dumps({name: {key: result[key] for key in (
            "elapsed_seconds", "output_tokens_per_second", "num_steps", "milliseconds_per_step",
            "device_busy_share") + (("mask_fills",) if fills else ())}}), flush=True)
        return result

    run("warm_up", warm_up, {index: constraint for index in range(0, 64, 4)})
    results.update(num_prompts=num_prompts, num_constrained=len(constrained))
    arms = ["unconstrained", "constrained"]
    rounds: list[dict[str, Any]] = []
    for _ in range(args.rounds):  # the arms interleaved: the machine drifts between rounds
        one_round = {name: run(name, workload, constrained if name == "constrained" else {})
                     for name in arms}
        one_round["constrained_over_unconstrained"] = (
            one_round["constrained"]["output_tokens_per_second"]
            / one_round["unconstrained"]["output_tokens_per_second"])
        print(json.dumps({"constrained_over_unconstrained":
                          one_round["constrained_over_unconstrained"]}), flush=True)
        rounds.append(one_round)
    results.update(rounds[0])  # the first round's figures where a single run's were
    if args.rounds > 1:
        results["rounds"] = rounds
        # tokens over seconds, all rounds together
        results["constrained_over_unconstrained_all_rounds"] = (
            sum(r["constrained"]["num_output_tokens"] for r in rounds)
            / sum(r["constrained"]["elapsed_seconds"] for r in rounds)
            / (sum(r["unconstrained"]["num_output_tokens"] for r in rounds)
               / sum(r["unconstrained"]["elapsed_seconds"] for r in rounds)))
    faulthandler.cancel_dump_traceback_later()
    return results


def _time_mask_fills() -> list[float]:
    """Seconds of each call of the scheduler's mask fill, from here on (patched in)."""
    from trio_llm.actors import scheduler as module

    fill, seconds = module.fill_bitmasks, []

    def timed_fill(grammars: Any) -> list[bytes]:
        started = time.perf_counter()
        try:
            return fill(grammars)
        finally:
            seconds.append(time.perf_counter() - started)

    module.fill_bitmasks = timed_fill
    return seconds


def _stats_snapshot(executor: CudaModelExecutor) -> dict[str, float]:
    if not isinstance(executor, CudaModelExecutor):
        return {}  # the ranks keep their statistics
    stats = executor.stats
    snapshot: dict[str, float] = {}
    for name in stats.__slots__:
        value = getattr(stats, name)
        if isinstance(value, dict):
            snapshot.update({f"{name}.{kind}": float(count) for kind, count in value.items()})
        else:
            snapshot[name] = float(value)
    return snapshot


def _profile(result: dict[str, Any], stats: dict[str, float],
             cpu_seconds: float) -> dict[str, Any]:
    num_steps = max(stats["num_steps"], 1)
    return {
        "executor_steps": stats["num_steps"],
        "graph_steps": stats["num_graph_steps"],
        "device_busy_share": stats["device_compute_seconds"] / result["elapsed_seconds"],
        "device_ms_per_step": 1000 * stats["device_compute_seconds"] / num_steps,
        "launch_host_ms_per_step": 1000 * stats["launch_seconds"] / num_steps,
        "collect_host_ms_per_step": 1000 * stats["collect_seconds"] / num_steps,
        "process_cpu_ms_per_step": 1000 * cpu_seconds / num_steps,
        "steps_by_kind": {kind: stats[f"num_steps_by_kind.{kind}"] for kind in STEP_KINDS},
        "graph_steps_by_kind": {kind: stats[f"num_graph_steps_by_kind.{kind}"]
                                for kind in STEP_KINDS},
        "launch_host_ms_per_step_by_kind": {
            kind: 1000 * stats[f"launch_seconds_by_kind.{kind}"]
            / max(stats[f"num_steps_by_kind.{kind}"], 1) for kind in STEP_KINDS},
        **{f"{part}_ms_per_step_by_kind": {
            kind: 1000 * stats[f"{part}_seconds_by_kind.{kind}"]
            / max(stats[f"num_steps_by_kind.{kind}"], 1) for kind in STEP_KINDS}
           for part in ("launch_wait", "plan", "pack")},
    }


# -- long context --------------------------------------------------------------------------


LONG_PROMPT_LEN = 32000


async def engine_long_prompt(config: EngineConfig, executor: CudaModelExecutor
                             ) -> dict[str, float]:
    """Time to the first token of a 32,000-token prompt, then ms per decoded token."""
    from trio_llm.api.engine import Engine

    prompt = [(7 * i) % 9000 + 100 for i in range(LONG_PROMPT_LEN)]
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    executor.drain()
    async with Engine.open(config, executor=executor) as engine:
        result: dict[str, float] = {}
        for run in ("warm", "timed"):
            started = time.perf_counter()
            times = []
            async for _ in engine.generate(prompt, params):
                times.append(time.perf_counter())
            result[f"{run}_ttft_seconds"] = times[0] - started
            result[f"{run}_decode_ms_per_token"] = (1000 * (times[-1] - times[0])
                                                    / (len(times) - 1))
    return result


def run_long(args: argparse.Namespace) -> dict[str, Any]:
    import trio

    results: dict[str, Any] = {"model": args.model, "prompt_len": LONG_PROMPT_LEN,
                               "num_new_tokens": NUM_NEW_TOKENS}
    # prefix caching off: the timed run repeats the warm run's prompt, which the cache
    # would serve without a prefill (2026-12-01 12:26: 0.044 s to the first token)
    overrides = {"max_num_seqs": 8, "num_kv_blocks": 2200, "max_model_len": 33000,
                 "enable_prefix_caching": False}
    executor = create_executor(engine_config(args.model, depth=2, **overrides))
    for depth in args.depths:
        results[f"depth_{depth}"] = trio.run(
            engine_long_prompt, engine_config(args.model, depth=depth, **overrides), executor)
        print(json.dumps({f"depth_{depth}": results[f"depth_{depth}"]}), flush=True)
    return results


# -- (e) transformers ----------------------------------------------------------------------


def run_transformers(args: argparse.Namespace) -> dict[str, Any]:
    from trio_llm.api.bench import random_workload
    from trio_llm.gpu.cuda_hf_baseline import run_transformers_throughput

    workload = random_workload(seed=0, num_prompts=args.num_prompts or 256,
                               prompt_len=(100, 1024), output_len=(100, 1024),
                               max_token_id=10000)
    return run_transformers_throughput(engine_config(args.model, depth=2), workload,
                                       temperature=0.6, time_limit_seconds=args.time_limit)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, run in (("decode", run_decode), ("throughput", run_throughput),
                      ("mixed", run_mixed), ("long", run_long), ("context", run_context),
                      ("transformers", run_transformers), ("structured", run_structured)):
        command = commands.add_parser(name)
        command.add_argument("--model", default="qwen3-0.6b")
        command.add_argument("--num-prompts", type=int, default=None,
                             help="throughput and transformers: 256, mixed: 2000")
        command.add_argument("--depths", type=int, nargs="+", default=[2, 1])
        command.add_argument("--time-limit", type=float, default=150.0)
        command.add_argument("--tensor-parallel-size", type=int, default=1,
                             help="decode, throughput: ranks (GPUs), one worker process each")
        command.add_argument("--stall-seconds", type=float, default=60.0,
                             help="structured: dump every stack after this long in one phase")
        command.add_argument("--contexts", type=int, nargs="+", default=None,
                             help="context: prompt lengths (default: 1k, 8k, 32k, 128k)")
        command.add_argument("--quantization", choices=["fp8"], default=None,
                             help="FP8 weights (the dummy weights rounded to e4m3 per row)")
        command.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
        command.add_argument("--engine-only", action="store_true",
                             help="decode: only the three engine runs at depth 2")
        command.add_argument("--rounds", type=int, default=1,
                             help="structured: the arms this many times, interleaved")
        command.set_defaults(run=run)
    args = parser.parse_args()
    global TENSOR_PARALLEL_SIZE
    TENSOR_PARALLEL_SIZE = args.tensor_parallel_size
    PRECISION.update(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    started = time.perf_counter()
    results = args.run(args)
    results["date"] = time.strftime("%Y-%m-%d")
    results["command"] = " ".join(["python3", *sys.argv])
    results["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    results["wall_seconds"] = time.perf_counter() - started
    suffix = f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    suffix += "-fp8" if args.quantization else ""
    suffix += "-fp8kv" if args.kv_cache_dtype == "fp8" else ""
    path = OUT / f"{args.command}-{args.model}{suffix}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main()
