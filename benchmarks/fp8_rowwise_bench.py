"""The row-wise FP8 GEMM of a batched decode step: cuBLASLt (``torch._scaled_mm``) beside
the Triton kernel (``fp8_gemm.rowwise_fp8_matmul``) at several tiles.

    python3 benchmarks/fp8_rowwise_bench.py [--rows 64 128 192 256] [--tiles 64,128,256,4,4]

At qwen3-8b's four projections (qkv, o, gate_up, down) with e4m3 weights and
activations already quantized (both paths share that kernel), each launch is timed by
CUDA events around a graph of ten launches (median of 20 replays), in microseconds,
and the Triton output checked against cuBLAS's. ``per_layer`` sums the four shapes: a
decoder layer's GEMMs at that row count. Writes $OUT/fp8_rowwise.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from cuda_timing import graph_launch_us  # benchmarks/, the script's folder

from trio_llm.gpu.kernels import fp8_gemm
from trio_llm.gpu.quantization import E4M3

# (out, in) of qwen3-8b's qkv, o, gate_up and down projections
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
          "down": (4096, 12288)}
# (block_m, block_n, block_k, num_warps, num_stages): the landed tile first, then the
# best of the two H100 sweeps at some shape and row count (docs/performance.md)
TILES = [(64, 128, 256, 4, 4), (64, 128, 256, 4, 3), (64, 64, 256, 4, 3),
         (64, 64, 128, 4, 4), (64, 64, 128, 4, 6), (128, 64, 128, 4, 4),
         (128, 128, 128, 8, 4), (64, 128, 128, 4, 3)]


def parse_tile(text: str) -> tuple[int, ...]:
    """``--tiles``' "64,128,256,4,4" as (64, 128, 256, 4, 4)."""
    return tuple(int(part) for part in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 192, 256])
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=TILES,
                        help="tiles as block_m,block_n,block_k,warps,stages")
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict[str, object] = {"device": torch.cuda.get_device_name()}
    weights = {name: ((torch.randn(out, inner, device="cuda") * 0.05).to(E4M3),
                      torch.rand(out, 1, device="cuda") * 0.01 + 0.001)
               for name, (out, inner) in SHAPES.items()}
    for rows in args.rows:
        per_layer: dict[str, float] = {}
        for name, (weight, weight_scale) in weights.items():
            values, scales = fp8_gemm.quantize_groups(
                torch.randn(rows, weight.shape[1], device="cuda", dtype=torch.bfloat16))

            def cublas(values=values, scales=scales, weight=weight, weight_scale=weight_scale):
                return torch._scaled_mm(values, weight.t(), scale_a=scales,
                                        scale_b=weight_scale.t(), out_dtype=torch.bfloat16)

            reference = cublas().float()
            timings = {"cublas": graph_launch_us(cublas)}
            for tile in args.tiles:
                config = fp8_gemm.RowwiseGemmConfig(*tile)

                def triton_gemm(values=values, scales=scales, weight=weight,
                                weight_scale=weight_scale, config=config):
                    return fp8_gemm.rowwise_fp8_matmul(values, scales, weight, weight_scale,
                                                       None, torch.bfloat16, config)

                try:
                    error = ((triton_gemm().float() - reference).norm()
                             / reference.norm()).item()
                    assert error < 1e-2, f"{tile}: relative error {error}"
                    timings[str(tile)] = graph_launch_us(triton_gemm)
                except Exception as failure:  # a tile past the shared memory
                    timings[str(tile)] = float("nan")
                    print(rows, name, tile, repr(failure)[:120], flush=True)
            results[f"{rows} {name}"] = timings
            for key, us in timings.items():
                per_layer[key] = per_layer.get(key, 0.0) + us
        results[f"{rows} per_layer"] = per_layer
        ranked = sorted(per_layer.items(), key=lambda item: item[1])
        print(rows, "rows, us a layer:", ", ".join(f"{key} {us:.1f}" for key, us in ranked),
              flush=True)
    Path(os.environ.get("OUT", "."), "fp8_rowwise.json").write_text(json.dumps(results,
                                                                               indent=1))


if __name__ == "__main__":
    main()
