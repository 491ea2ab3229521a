"""Sweep gemv launch configurations inside a captured batch-1 decode graph.

    python3 benchmarks/gemv_sweep.py [--model qwen3-8b] [--quantization fp8]

Each configuration (widest outputs per program, K tile, warps, stages) replaces
the rule for every single-row linear layer (with ``--quantization fp8``, for every
e4m3 projection: one byte a weight, so a tile holds half bf16's bytes in flight),
gate/up's SwiGLU launch included (the sweep used to replace the layers' forward,
which that launch bypasses: the FP8 sweep of 2026-12-07 left gate/up on the rule);
the decode graph is captured again and its replay timed (device time, median).
Also reports the executor's device time per decode step (CUDA events around each
step's compute: the graph plus the work outside it). Writes $OUT/gemv_sweep.json
(gemv_sweep-fp8.json).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gpu_bench  # benchmarks/ is on sys.path when run as a script

from trio_llm.gpu import cuda_startup
from trio_llm.gpu.kernels import triton_gemv
from trio_llm.gpu.layers.fp8_linear import Fp8Linear
from trio_llm.gpu.models import cuda_fused

SWEEP = [(4, 512, 1, 1), (4, 256, 1, 1), (2, 512, 1, 1), (8, 512, 1, 1), (8, 256, 1, 1),
         (4, 1024, 2, 1), (8, 512, 2, 1), (4, 512, 1, 2), (2, 1024, 1, 1), (1, 1024, 1, 1),
         (4, 512, 1, 3), (8, 1024, 2, 1),
         # one output, up to 2048 or 4096 of K in one step, a warp per 1024 (rule
         # `one_output` gives layers of few outputs, the MoE router, this shape)
         (1, 2048, 2, 1), (1, 4096, 4, 1), (1, 2048, 1, 1)]
# e4m3 weights: a tile holds half bf16's bytes, so wider tiles and more warps a program
# (an SM holds at most 32 programs: one-warp programs fill half its 64 warps) come first
FP8_SWEEP = [(1, 1024, 1, 1), (1, 2048, 1, 1), (1, 2048, 2, 1), (2, 1024, 1, 1),
             (2, 2048, 1, 1), (1, 4096, 2, 1), (1, 4096, 4, 1), (4, 1024, 1, 1),
             (2, 2048, 2, 1), (2, 1024, 2, 1), (4, 512, 1, 1), (1, 4096, 1, 1),
             (1, 2048, 1, 2), (2, 1024, 1, 2)]


def config_with(weight, widest: int, block_k: int, num_warps: int, num_stages: int):
    num_outputs, num_inputs = weight.shape
    return triton_gemv.GemvConfig(triton_gemv._block_n(num_outputs, widest),
                                  triton_gemv._block_k(num_inputs, block_k),
                                  num_warps, num_stages)


def gemv_rows_with(*combo: int):
    """A layer's GEMV rows under the swept configuration: every single-row projection,
    gate/up's SwiGLU launch included (GemvLinear and Fp8Linear both multiply through
    ``gemv_rows``)."""
    def gemv_rows(self, rows, *, swiglu: bool = False):
        return triton_gemv.gemv(rows, self.weight, self.bias,
                                weight_scale=getattr(self, "weight_scale", None),
                                block_size=getattr(self, "block_size", None), swiglu=swiglu,
                                config=config_with(self.weight, *combo))
    return gemv_rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="FP8 weights (per channel): sweep the FP8 GEMV instead")
    args = parser.parse_args()
    config = gpu_bench.engine_config(args.model, depth=2, max_num_seqs=1, num_kv_blocks=1024,
                                     max_model_len=4096, quantization=args.quantization)
    executor = gpu_bench.create_executor(config, measure_device_time=True)
    results: dict[str, object] = {"model": args.model, "quantization": args.quantization,
                                  "default graph": gpu_bench.graph_replay_ms(executor, 1)}
    compute_before, steps_before = executor.stats.device_compute_seconds, executor.stats.num_steps
    results["executor depth 2 ms/token"] = gpu_bench.executor_decode_ms_per_token(
        executor, depth=2, request_id="sweep")
    num_steps = executor.stats.num_steps - steps_before
    results["device compute ms per step (events, prefill included)"] = (
        1000 * (executor.stats.device_compute_seconds - compute_before) / num_steps)
    print(results, flush=True)
    for combo in FP8_SWEEP if args.quantization else SWEEP:
        try:
            patched = Fp8Linear if args.quantization else cuda_fused.GemvLinear
            patched.gemv_rows = gemv_rows_with(*combo)  # type: ignore[method-assign]
            executor.graphs.clear()
            cuda_startup.capture_graphs(executor)
            replay: object = gpu_bench.graph_replay_ms(executor, 1)
        except Exception as error:  # one failing configuration must not end the sweep
            replay = repr(error)[:200]
        results[str(combo)] = replay
        print(combo, replay, flush=True)
    name = f"gemv_sweep{'-fp8' if args.quantization else ''}.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
