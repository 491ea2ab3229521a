"""Which kernels one captured decode step runs, and for how long: the CUDA graph of
``--num-seqs`` sequences replayed under torch.profiler (CUPTI sees the kernels inside
a graph). Prints the kernels by total device time with their counts; writes
$OUT/graph_profile-<model>-<num_seqs>.txt.

    python3 benchmarks/graph_profile.py --model qwen3-30b-a3b --num-seqs 1 64 256
    python3 benchmarks/graph_profile.py --model qwen3-8b --num-seqs 256 --quantization fp8 \
        --kv-cache-dtype fp8

With programmatic dependent launch on (the default on Hopper) a kernel starts while
the one before it runs, and its time includes that wait: per-kernel times then
overlap, and only the batched steps' large kernels read true (TRIO_LLM_PDL=0 for a
single stream's).
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import torch
from step_profile import decode_inputs, set_graph_inputs  # benchmarks/, the script's folder
from torch.profiler import ProfilerActivity, profile

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.cuda_executor import CudaModelExecutor


def profile_graph(executor: CudaModelExecutor, num_seqs: int, num_replays: int) -> str:
    graph = executor.graphs.get(num_seqs)
    assert graph is not None, f"no decode graph of {num_seqs} sequences"
    # A hybrid model's graph also reads state slots: it replays the inputs it was
    # captured with (the warm-up's short contexts, each sequence in its slot).
    as_captured = executor.model.num_linear_attention_layers > 0
    with torch.inference_mode(), torch.cuda.stream(executor.compute.torch_stream):
        if not as_captured:
            rng = random.Random(0)
            context_lens = [rng.randint(100, 2048) for _ in range(num_seqs)]
            set_graph_inputs(executor, *decode_inputs(executor, context_lens, shuffled=True))
        for _ in range(5):
            graph.graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(num_replays):
                graph.graph.replay()
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                      max_name_column_width=90)
    inputs_note = " (inputs as captured)" if as_captured else ""
    return f"{num_replays} replays of the {num_seqs}-sequence decode graph{inputs_note}\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--num-replays", type=int, default=20)
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    args = parser.parse_args()
    # graphs up to the largest count asked for (a large hybrid model's state slots for
    # the default 256 sequences can leave no memory for the KV cache)
    executor = CudaModelExecutor.create(EngineConfig(
        model=args.model, load_format="dummy", device="cuda",
        max_num_seqs=max(args.num_seqs), quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype))
    suffix = ("-fp8" if args.quantization else "") + (
        "-fp8kv" if args.kv_cache_dtype == "fp8" else "")
    for num_seqs in args.num_seqs:
        text = profile_graph(executor, num_seqs, args.num_replays)
        print(text, flush=True)
        Path(os.environ.get("OUT", "."), f"graph_profile-{args.model}{suffix}-{num_seqs}.txt"
             ).write_text(text)


if __name__ == "__main__":
    main()
