"""The FP8 GEMMs alone on the device, beside bf16, at qwen3-8b's projection shapes.

    python3 benchmarks/fp8_gemm_bench.py            # JSON under $OUT

For each shape (qkv, o, gate_up, down of qwen3-8b) and row count (1, 8, 64, 512,
4096): bf16 ``F.linear``; the per-channel path (per-token activation quantization +
row-wise ``torch._scaled_mm``); the block path (per-token-group quantization + the
block-scaled Triton GEMM, 128 x 128 weight blocks). Median device time of 50
launches after 10 warm-ups (CUDA events), in microseconds, and the weight bandwidth
each reaches (the weight bytes over the time: decode's bound). ``--quick`` runs one
shape on the CPU (Triton's interpreter): a smoke test of the script, not a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from trio_llm.gpu.kernels import fp8_gemm
from trio_llm.gpu.quantization import quantize_blocks, quantize_rows

OUT = Path(os.environ.get("OUT", "."))
# qwen3-8b: hidden 4096, 32 heads and 8 KV heads of 128, intermediate 12288
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
          "down_proj": (4096, 12288)}
ROW_COUNTS = (1, 8, 64, 512, 4096)
BLOCK = (128, 128)


def device_microseconds(run: Callable[[], object], *, repeats: int = 50) -> float:
    for _ in range(10):
        run()
    if not torch.cuda.is_available():
        started = time.perf_counter()
        run()
        return 1e6 * (time.perf_counter() - started)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end))
    return statistics.median(times)


def measure(num_out: int, num_in: int, num_rows: int, device: torch.device) -> dict[str, float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(num_out, num_in, device=device) * 0.02
    rows, blocks = quantize_rows(weight), quantize_blocks(weight, BLOCK)
    x = torch.randn(num_rows, num_in, device=device).to(dtype)
    plain = weight.to(dtype)
    results = {"bf16_us": device_microseconds(lambda: F.linear(x, plain)),
               "block_us": device_microseconds(lambda: fp8_gemm.block_scaled_linear(
                   x, blocks.values, blocks.scale, BLOCK, None))}
    if device.type == "cuda":
        results["channel_us"] = device_microseconds(lambda: fp8_gemm.scaled_mm_rowwise(
            x, rows.values, rows.scale, None))
    for name in list(results):
        weight_bytes = num_out * num_in * (2 if name == "bf16_us" else 1)
        results[name.replace("_us", "_weight_gbps")] = weight_bytes / results[name] / 1e3
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"tiny": (64, 256)} if args.quick else SHAPES
    row_counts = (1, 3) if args.quick else ROW_COUNTS
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"), "block": BLOCK}
    for name, (num_out, num_in) in shapes.items():
        for num_rows in row_counts:
            key = f"{name}-{num_rows}"
            results[key] = measure(num_out, num_in, num_rows, device)
            print(key, json.dumps(results[key]), flush=True)
    (OUT / "fp8_gemm_bench.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
