"""Decode-step graph replay with the gate/up GEMV's SwiGLU fused into its launch and
not (the projection, then the SwiGLU kernel): device time inside the captured graph.

    python3 benchmarks/swiglu_graph_ab.py [--model qwen3-8b] [--quantization none|fp8]

The model is captured and replayed under both, twice in turn (so a drift of the clocks
shows as a difference between the rounds). One executor a process: a second one built
after the first in the same process failed its warm-up on an H100 (an index_select
out of range, 2026-12-06), which a fresh process did not. Writes
$OUT/swiglu_graph_ab-MODEL-QUANTIZATION.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gpu_bench  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from trio_llm.gpu import cuda_startup
from trio_llm.gpu.kernels import triton_layers
from trio_llm.gpu.models import cuda_fused

FUSED = cuda_fused.TritonOps.gate_up_silu


def unfused(hidden, gate_up_proj, *, quantize=False):
    """The SwiGLU kernel after the projection, decode rows too; rows that an FP8 down
    projection takes in e4m3 (never decode rows) as the engine runs them."""
    if quantize:
        return FUSED(hidden, gate_up_proj, quantize=True)
    return triton_layers.silu_and_mul(gate_up_proj(hidden))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none")
    args = parser.parse_args()
    config = gpu_bench.engine_config(
        args.model, depth=2, max_num_seqs=8, num_kv_blocks=1024, max_model_len=4096,
        quantization=None if args.quantization == "none" else args.quantization)
    executor = gpu_bench.create_executor(config)
    results = {}
    for round_ in (1, 2):
        for name, gate_up_silu in (("fused", FUSED), ("unfused", unfused)):
            cuda_fused.TritonOps.gate_up_silu = staticmethod(gate_up_silu)
            executor.graphs.clear()
            cuda_startup.capture_graphs(executor)
            for batch in (1, 2):
                ms = gpu_bench.graph_replay_ms(executor, batch)
                key = f"{args.model} {args.quantization} {name} batch {batch} round {round_}"
                results[key] = ms
                print(f"{key}: {ms:.4f} ms", flush=True)
    cuda_fused.TritonOps.gate_up_silu = staticmethod(FUSED)
    name = f"swiglu_graph_ab-{args.model}-{args.quantization}.json"
    (Path(os.environ.get("OUT", ".")) / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
