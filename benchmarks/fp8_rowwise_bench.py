"""The row-wise FP8 GEMM of a batched step: cuBLASLt (``torch._scaled_mm``) beside the
Triton kernel (``fp8_gemm.rowwise_fp8_matmul``) at several tiles, and its tuning.

    python3 benchmarks/fp8_rowwise_bench.py [--model qwen3-8b] [--rows 64 128 192 256]
        [--tiles 64,128,256,4,4 ...]
    python3 benchmarks/fp8_rowwise_bench.py --tune [--model qwen3-8b]

At the model's projections (qkv, o and, for a dense model, gate_up and down: this
rank's shapes at TP 1) with e4m3 weights and activations already quantized (both paths
share that kernel), each launch is timed by CUDA events around a graph of ten launches
(median of 20 replays) that cycle through ``--copies`` copies of the weight, so that a
weight is not read from the L2 cache as a model's next layer would not be, in
microseconds, and the Triton output checked against cuBLAS's. ``per_layer`` sums the
shapes: a decoder layer's GEMMs at that row count. Writes $OUT/fp8_rowwise.json.

``--tune`` times every row count a step's GEMM meets in a captured graph (``TUNE_ROWS``:
the decode graphs' batch sizes and the varlen graphs' token counts up to 1,024) and
writes each shape's fastest choice by row count, a tile or cuBLAS, as its tuned table
(``fp8_gemm.read_table``'s format) into $TRIO_LLM_FP8_GEMM_CONFIGS, else
$OUT/fp8_gemm_configs; gpu/kernels/fp8_gemm_configs/ holds the committed ones. Row
counts past the table take the default rule (``fp8_gemm.rowwise_gemm_config``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
from cuda_timing import graph_launch_us  # benchmarks/, the script's folder

from trio_llm.gpu.builtin import DUMMY_ONLY_CONFIGS
from trio_llm.gpu.kernels import fp8_gemm
from trio_llm.gpu.quantization import E4M3

# (block_m, block_n, block_k, num_warps, num_stages): the default rule's tile first,
# then the best of two H100 sweeps at some shape and row count (docs/performance.md)
TILES = [(64, 128, 256, 4, 4), (64, 128, 256, 4, 3), (64, 64, 256, 4, 3),
         (64, 64, 128, 4, 4), (64, 64, 128, 4, 6), (128, 64, 128, 4, 4),
         (128, 128, 128, 8, 4), (64, 128, 128, 4, 3)]
# Row counts past GEMV_ROWS that a captured graph gives the GEMM (gpu/cuda_graphs.py's
# decode batch sizes and varlen token counts up to 1,024; more rows are compute-bound
# and cuBLAS's).
TUNE_ROWS = [4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
             448, 512, 640, 768, 1024]
MODELS = ("qwen3-8b", "qwen3-30b-a3b", "qwen3-0.6b")


def projection_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(out, in) of the model's FP8 projections at TP 1: attention's, and the MLP's in a
    dense model (an MoE model's experts take the fused MoE kernel)."""
    config = DUMMY_ONLY_CONFIGS[model]
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
              "o": (hidden, heads * head_dim)}
    if "num_experts" not in config:
        intermediate = config["intermediate_size"]
        shapes |= {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
    return shapes


def parse_tile(text: str) -> tuple[int, ...]:
    """``--tiles``' "64,128,256,4,4" as (64, 128, 256, 4, 4)."""
    return tuple(int(part) for part in text.split(","))


def time_shape(rows: int, weights: list[tuple[torch.Tensor, torch.Tensor]],
               tiles: list[tuple[int, ...]]) -> dict[str, float]:
    """Microseconds a launch at ``rows`` rows: cuBLAS's and each tile's (NaN: it failed)."""
    values, scales = fp8_gemm.quantize_groups(
        torch.randn(rows, weights[0][0].shape[1], device="cuda", dtype=torch.bfloat16))
    weight, weight_scale = weights[0]
    reference = torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scale.t(),
                                 out_dtype=torch.bfloat16).float()
    copies = itertools.cycle(weights)

    def cublas():
        weight, weight_scale = next(copies)
        return torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scale.t(),
                                out_dtype=torch.bfloat16)

    timings = {"cublas": graph_launch_us(cublas)}
    for tile in tiles:
        config = fp8_gemm.RowwiseGemmConfig(*tile)

        def triton_gemm(config=config):
            weight, weight_scale = next(copies)
            return fp8_gemm.rowwise_fp8_matmul(values, scales, weight, weight_scale, None,
                                               torch.bfloat16, config)

        try:
            out = fp8_gemm.rowwise_fp8_matmul(values, scales, weight, weight_scale, None,
                                              torch.bfloat16, config).float()
            error = ((out - reference).norm() / reference.norm()).item()
            assert error < 1e-2, f"{tile}: relative error {error}"
            timings[str(tile)] = graph_launch_us(triton_gemm)
        except Exception as failure:  # a tile past the shared memory
            timings[str(tile)] = float("nan")
            print(rows, tile, repr(failure)[:120], flush=True)
    return timings


def fastest(timings: dict[str, float]) -> str:
    return min((key for key in timings if not math.isnan(timings[key])),
               key=lambda key: timings[key])


def write_table(shape: tuple[int, int], by_rows: dict[int, dict[str, float]],
                folder: Path) -> Path:
    """The shape's tuned table: at each row count the fastest choice (a tile or cuBLAS)."""
    configs = []
    for rows, timings in sorted(by_rows.items()):
        best = fastest(timings)
        configs.append({"rows": rows, "tile": None if best == "cublas" else
                        list(parse_tile(best.strip("()").replace(" ", ""))),
                        "us": round(timings[best], 2), "cublas_us": round(timings["cublas"], 2)})
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / fp8_gemm.tuned_table_name(*shape, torch.cuda.get_device_name())
    path.write_text(json.dumps({"environment": {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "triton": triton.__version__, "device": torch.cuda.get_device_name(),
        "cuda": torch.version.cuda}, "shape": {"out": shape[0], "in": shape[1]},
        "configs": configs}, indent=2))
    fp8_gemm.read_table(path)  # it must read back
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=MODELS, default="qwen3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="row counts (default 64 128 192 256; --tune: TUNE_ROWS)")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=TILES,
                        help="tiles as block_m,block_n,block_k,warps,stages")
    parser.add_argument("--copies", type=int, default=4,
                        help="weight copies a graph cycles through (out of the L2 cache)")
    parser.add_argument("--tune", action="store_true",
                        help="write each shape's tuned table (see the docstring)")
    args = parser.parse_args()
    rows_list = args.rows or (TUNE_ROWS if args.tune else [64, 128, 192, 256])
    torch.manual_seed(0)
    shapes = projection_shapes(args.model)
    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "model": args.model,
                                  "shapes": shapes}
    weights = {name: [((torch.randn(out, inner, device="cuda") * 0.05).to(E4M3),
                       torch.rand(out, 1, device="cuda") * 0.01 + 0.001)
                      for _ in range(args.copies)]
               for name, (out, inner) in shapes.items()}
    by_shape: dict[str, dict[int, dict[str, float]]] = {name: {} for name in shapes}
    for rows in rows_list:
        per_layer: dict[str, float] = {}
        for name, copies in weights.items():
            timings = by_shape[name][rows] = results[f"{rows} {name}"] = time_shape(
                rows, copies, args.tiles)
            for key, us in timings.items():
                per_layer[key] = per_layer.get(key, 0.0) + us
            print(f"{rows} {name}: cublas {timings['cublas']:.1f}, best "
                  f"{fastest(timings)} {timings[fastest(timings)]:.1f}", flush=True)
        results[f"{rows} per_layer"] = per_layer
        ranked = sorted(per_layer.items(), key=lambda item: item[1])
        print(rows, "rows, us a layer:", ", ".join(f"{key} {us:.1f}" for key, us in ranked),
              flush=True)
    out = Path(os.environ.get("OUT", "."))
    if args.tune:
        folder = Path(os.environ.get(fp8_gemm.FP8_GEMM_CONFIGS_ENV)
                      or out / "fp8_gemm_configs")
        for name, shape in shapes.items():
            print("wrote", write_table(shape, by_shape[name], folder), flush=True)
    (out / "fp8_rowwise.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
