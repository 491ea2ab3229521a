"""Which kernels one captured decode step runs, and for how long: the CUDA graph of
``--num-seqs`` sequences replayed under torch.profiler (CUPTI sees the kernels inside
a graph). Prints the kernels by total device time with their counts, then each kernel
by launch grid (a GEMV's grid tells which layer it is: qkv, o, router, lm_head), and the
replay's own time beside the kernels' sum (the difference: the gaps between kernels);
writes $OUT/graph_profile-<model>-<num_seqs>.txt.

    python3 benchmarks/graph_profile.py --model qwen3-30b-a3b --num-seqs 1 64 256
    python3 benchmarks/graph_profile.py --model qwen3-8b --num-seqs 256 --quantization fp8 \
        --kv-cache-dtype fp8
    TRIO_LLM_PDL=0 python3 benchmarks/graph_profile.py --model qwen3.5-27b --num-seqs 1 \
        --after-decode   # at the decode's real context and state, not start-up's inputs

With programmatic dependent launch on (the default on Hopper) a kernel starts while
the one before it runs, and its time includes that wait: per-kernel times then
overlap, and only the batched steps' large kernels read true (TRIO_LLM_PDL=0 for a
single stream's).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

import torch
from cuda_timing import event_times_ms  # benchmarks/, the script's folder
from step_profile import decode_inputs, set_graph_inputs
from torch.profiler import ProfilerActivity, profile

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.cuda_executor import CudaModelExecutor


def profile_graph(executor: CudaModelExecutor, num_seqs: int, num_replays: int,
                  context: int | None = None, after_decode: bool = False) -> str:
    graph = executor.graphs.get(num_seqs)
    assert graph is not None, f"no decode graph of {num_seqs} sequences"
    # A hybrid model's graph also reads state slots: it replays the inputs it was
    # captured with (the warm-up's short contexts, each sequence in its slot), or, after
    # a decode, the last decode step's (``after_decode``: one sequence, its real slot).
    as_captured = executor.model.num_linear_attention_layers > 0
    inputs_note = " (inputs as captured)" if as_captured else ""
    if after_decode:
        from gpu_bench import executor_decode_ms_per_token

        executor_decode_ms_per_token(executor, depth=1, request_id=f"profile-{num_seqs}")
        as_captured, inputs_note = True, " (the inputs of a 128-token prompt's 256th decode step)"
    with torch.inference_mode(), torch.cuda.stream(executor.compute.torch_stream):
        if not as_captured:
            rng = random.Random(0)
            context_lens = [context or rng.randint(100, 2048) for _ in range(num_seqs)]
            set_graph_inputs(executor, *decode_inputs(executor, context_lens, shuffled=True))
        for _ in range(5):
            graph.graph.replay()
        torch.cuda.synchronize()
        replay_ms = statistics.median(event_times_ms(graph.graph.replay, num_replays))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(num_replays):
                graph.graph.replay()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                      max_name_column_width=90)
    return (f"{num_replays} replays of the {num_seqs}-sequence decode graph{inputs_note}\n"
            f"{table}\n{by_grid(prof, num_replays, replay_ms)}")


def by_grid(prof: profile, num_replays: int, replay_ms: float) -> str:
    """Each kernel by launch grid (from the profiler's trace): launches and device time a
    replay, and the replay's own time (CUDA events) beside the kernels' sum."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "trace.json")
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.get("cat") != "kernel":
            continue
        grid = event.get("args", {}).get("grid")
        key = (event["name"][:60], "x".join(map(str, grid)) if grid else "?")
        totals[key][0] += 1
        totals[key][1] += event.get("dur", 0.0)
    lines = [f"{'kernel':60}  {'grid':>14}  {'a replay':>8}  {'us each':>8}  {'us a replay':>11}"]
    kernels_us = 0.0
    for (name, grid), (count, total_us) in sorted(totals.items(), key=lambda item: -item[1][1]):
        kernels_us += total_us / num_replays
        lines.append(f"{name:60}  {grid:>14}  {count / num_replays:8.1f}  "
                     f"{total_us / count:8.2f}  {total_us / num_replays:11.1f}")
    lines.append(f"kernels' sum {kernels_us / 1000:.3f} ms a replay; the replay alone "
                 f"(CUDA events, median of {num_replays}) {replay_ms:.3f} ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--num-replays", type=int, default=20)
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--context", type=int, default=None,
                        help="every sequence's context (default: random, 100-2,048)")
    parser.add_argument("--after-decode", action="store_true",
                        help="one sequence, profiled at the last step of a real decode "
                             "(a hybrid model's state in its slot)")
    args = parser.parse_args()
    if args.after_decode and args.num_seqs != [1]:
        parser.error("--after-decode profiles the one-sequence graph: --num-seqs 1")
    # graphs up to the largest count asked for (a large hybrid model's state slots for
    # the default 256 sequences can leave no memory for the KV cache)
    executor = CudaModelExecutor.create(EngineConfig(
        model=args.model, load_format="dummy", device="cuda",
        max_num_seqs=max(args.num_seqs), quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype))
    suffix = ("-fp8" if args.quantization else "") + (
        "-fp8kv" if args.kv_cache_dtype == "fp8" else "")
    for num_seqs in args.num_seqs:
        text = profile_graph(executor, num_seqs, args.num_replays, args.context,
                             args.after_decode)
        print(text, flush=True)
        Path(os.environ.get("OUT", "."), f"graph_profile-{args.model}{suffix}-{num_seqs}.txt"
             ).write_text(text)


if __name__ == "__main__":
    main()
