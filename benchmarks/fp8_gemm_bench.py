"""The FP8 GEMMs alone on the device, beside bf16, at qwen3-8b's projection shapes.

    python3 benchmarks/fp8_gemm_bench.py            # JSON under $OUT
    python3 benchmarks/fp8_gemm_bench.py --decode   # the decode rows only (device_run.sh fp8-gemv)

For each shape (qkv, o, gate_up, down of qwen3-8b) and row count (1 to 4,096:
``ROW_COUNTS``): bf16 ``F.linear``; the per-channel path (per-token activation quantization +
``scaled_mm_rowwise``: the Triton row-wise GEMM or ``torch._scaled_mm`` by its rule,
fp8_rowwise_bench.py compares the two); the block path (per-token-group quantization + the
block-scaled Triton GEMM, 128 x 128 weight blocks) and, where it runs, the same
quantization (scales stored group by group) with cuBLASLt's block-scaled GEMM
(``cublas_block``: ``fp8_gemm.cublas_block_linear``, its error against the Triton GEMM
beside it; odd row counts included, which it must take). Each
launch's device time from replays of a CUDA graph of ten launches in a row (the
engine's steps run so; timed one by one, the GEMMs of a few rows measured the host's
launch path: the nineteenth session's table), in microseconds, and the weight
bandwidth each reaches (the weight bytes over the time: decode's bound). ``--quick`` runs one
shape on the CPU (Triton's interpreter): a smoke test of the script, not a figure.

Then the decode rows (1 and 2, where the layers take the GEMV: ``GEMV_ROWS``), each
kernel first checked against float32 ``x W^T`` of its dequantized weight, then timed
with ``triton.testing.do_bench`` (median; it flushes L2 between runs, so the weights
come from memory as in a decode step, where the others above may find a small weight
in L2): the bf16 GEMV and cuBLAS; the FP8 GEMV per channel and per 128 x 128 block
(the default rule, e4m3's own, and ``_bf16_tile``: the bf16 rule's tile, e4m3's rule
from 2026-12-06 to 2026-12-07, faster alone here but slower in the decode graph:
benchmarks/gemv_sweep.py); the GEMM paths
they replace (quantization + ``scaled_mm_rowwise``; quantization + the block GEMM).
``decode_step_us`` sums each kernel over qwen3-8b's 36 layers (qkv, o, gate_up, down):
the projections' share of one token.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from cuda_timing import graph_launch_us

from trio_llm.gpu.kernels import fp8_gemm, triton_gemv
from trio_llm.gpu.quantization import Fp8Weight, quantize_blocks, quantize_rows

OUT = Path(os.environ.get("OUT", "."))
# qwen3-8b: hidden 4096, 32 heads and 8 KV heads of 128, intermediate 12288
SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
          "down_proj": (4096, 12288)}
ROW_COUNTS = (1, 4, 8, 13, 64, 200, 512, 1000, 4096)
BLOCK = (128, 128)
NUM_LAYERS = 36  # qwen3-8b
DECODE_ROW_COUNTS = (1, 2)


def device_microseconds(run: Callable[[], object]) -> float:
    """Microseconds a launch of ``run`` on the device, from replays of a CUDA graph of
    launches in a row (``graph_launch_us``: the engine runs its steps so; timed one by
    one, a small GEMM measured the host's launch path); on the CPU one timed run."""
    for _ in range(3):
        run()
    if not torch.cuda.is_available():
        started = time.perf_counter()
        run()
        return 1e6 * (time.perf_counter() - started)
    return graph_launch_us(run)


def measure(num_out: int, num_in: int, num_rows: int, device: torch.device) -> dict[str, float]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(num_out, num_in, device=device) * 0.02
    rows, blocks = quantize_rows(weight), quantize_blocks(weight, BLOCK)
    x = torch.randn(num_rows, num_in, device=device).to(dtype)
    plain = weight.to(dtype)

    def triton_blocks() -> torch.Tensor:
        values, scales = fp8_gemm.quantize_groups(x, BLOCK[1])
        return fp8_gemm.block_fp8_matmul(values, scales, blocks.values, blocks.scale, BLOCK,
                                         None, dtype)

    results = {"bf16_us": device_microseconds(lambda: F.linear(x, plain)),
               "block_us": device_microseconds(triton_blocks)}
    if device.type == "cuda":
        results["channel_us"] = device_microseconds(lambda: fp8_gemm.scaled_mm_rowwise(
            x, rows.values, rows.scale, None))
        cublas_us, error = cublas_blocks(x, blocks, triton_blocks())
        if cublas_us is not None:
            results["cublas_block_us"] = cublas_us
    for name in list(results):
        weight_bytes = num_out * num_in * (2 if name == "bf16_us" else 1)
        results[name.replace("_us", "_weight_gbps")] = weight_bytes / results[name] / 1e3
    if "cublas_block_us" in results:
        results["cublas_block_relative_error"] = error
    return results


def cublas_blocks(x: torch.Tensor, blocks: Fp8Weight, reference: torch.Tensor
                  ) -> tuple[float | None, float | None]:
    """``cublas_block_linear`` (the quantization included): its time and its error
    against the Triton block GEMM, or (None, None) with the reason printed where it does
    not run here."""
    def run() -> torch.Tensor:
        return fp8_gemm.cublas_block_linear(x, blocks.values, blocks.scale, None)

    try:
        error = ((run().float() - reference.float()).norm() / reference.float().norm()).item()
    except Exception as failure:  # an old torch, a GPU without it, a row count it refuses
        print(f"cublas blocks, {x.shape[0]} rows: {repr(failure)[:200]}", flush=True)
        return None, None
    return device_microseconds(run), error


def decode_microseconds(run: Callable[[], object]) -> float:
    """Median device time with L2 flushed before each run (the CPU: one timed run)."""
    if not torch.cuda.is_available():
        return device_microseconds(run)
    from triton.testing import do_bench

    return 1e3 * do_bench(run, warmup=10, rep=50, return_mode="median")


def decode_kernels(weight: torch.Tensor, dtype: torch.dtype
                   ) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor,
                                        int]]:
    """name -> (the layer's function of x, the float32 weight it multiplies, weight bytes)."""
    rows, blocks = quantize_rows(weight), quantize_blocks(weight, BLOCK)
    plain = weight.to(dtype)
    num_out, num_in = weight.shape

    def fp8_gemv(fp8: Fp8Weight, config: triton_gemv.GemvConfig | None = None
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: triton_gemv.gemv(x, fp8.values, weight_scale=fp8.scale,
                                          block_size=fp8.block_size, config=config)

    bf16_tile = triton_gemv.gemv_config(num_out, num_in)
    kernels = {
        "bf16_gemv": (lambda x: triton_gemv.gemv(x, plain), plain.float(), 2 * weight.numel()),
        "bf16_cublas": (lambda x: F.linear(x, plain), plain.float(), 2 * weight.numel()),
        "fp8_gemv_channel": (fp8_gemv(rows), rows.dequantize(), weight.numel()),
        "fp8_gemv_blocks": (fp8_gemv(blocks), blocks.dequantize(), weight.numel()),
        "fp8_gemv_channel_bf16_tile": (fp8_gemv(rows, bf16_tile), rows.dequantize(),
                                       weight.numel()),
        "fp8_gemv_blocks_bf16_tile": (fp8_gemv(blocks, bf16_tile), blocks.dequantize(),
                                      weight.numel()),
        "fp8_block_gemm": (lambda x: fp8_gemm.block_scaled_linear(
            x, blocks.values, blocks.scale, BLOCK, None), blocks.dequantize(), weight.numel()),
    }
    if weight.device.type == "cuda":
        kernels["fp8_scaled_mm"] = (lambda x: fp8_gemm.scaled_mm_rowwise(
            x, rows.values, rows.scale, None), rows.dequantize(), weight.numel())
    return kernels


def measure_decode(num_out: int, num_in: int, device: torch.device) -> dict[str, dict]:
    """Each kernel at each decode row count: its error against float32 (the GEMM paths
    also round the activations: larger), then its time and weight bandwidth."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    weight = torch.randn(num_out, num_in, device=device) * 0.02
    x = torch.randn(max(DECODE_ROW_COUNTS), num_in, device=device).to(dtype)
    results: dict[str, dict] = {}
    for name, (run, dequantized, weight_bytes) in decode_kernels(weight, dtype).items():
        for num_rows in DECODE_ROW_COUNTS:
            rows = x[:num_rows]
            expected = rows.float() @ dequantized.T
            error = ((run(rows).float() - expected).norm() / expected.norm()).item()
            microseconds = decode_microseconds(lambda: run(rows))  # noqa: B023
            results[f"{name}-{num_rows}"] = {
                "us": microseconds, "weight_gbps": weight_bytes / microseconds / 1e3,
                "relative_error": error}
    return results


def decode_step(results: dict[str, dict[str, dict]]) -> dict[str, float]:
    """Each kernel's time summed over the shapes, times the layers: one token's
    projections (the lm_head and attention excluded)."""
    totals: dict[str, float] = {}
    for by_kernel in results.values():
        for key, record in by_kernel.items():
            totals[key] = totals.get(key, 0.0) + NUM_LAYERS * record["us"]
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--decode", action="store_true", help="the decode rows only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = {"tiny": (64, 256)} if args.quick else SHAPES
    row_counts = (1, 3) if args.quick else ROW_COUNTS
    results: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M"), "block": BLOCK}
    for name, (num_out, num_in) in shapes.items() if not args.decode else ():
        for num_rows in row_counts:
            key = f"{name}-{num_rows}"
            results[key] = measure(num_out, num_in, num_rows, device)
            print(key, json.dumps(results[key]), flush=True)
    decode: dict[str, dict[str, dict]] = {}
    for name, (num_out, num_in) in shapes.items():
        decode[name] = measure_decode(num_out, num_in, device)
        for key, record in decode[name].items():
            print(f"decode {name} {key}", json.dumps(record), flush=True)
    step_us = decode_step(decode)
    results["decode"] = decode
    results["decode_step_us"] = step_us
    for key, microseconds in sorted(step_us.items(), key=lambda item: item[1]):
        print(f"decode step {key}: {microseconds:.0f} us", flush=True)
    name = "fp8_gemm_bench_decode.json" if args.decode else "fp8_gemm_bench.json"
    (OUT / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
