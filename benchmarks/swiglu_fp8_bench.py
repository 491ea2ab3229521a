"""The SwiGLU handed to a per-channel FP8 down projection, at qwen3-8b's width and a
batched decode step's rows: ``silu_and_mul_fp8`` (one kernel) at each chunk width
against ``silu_and_mul`` then ``quantize_groups`` (two kernels, what it replaced).

    python3 benchmarks/swiglu_fp8_bench.py [--rows 256] [--intermediate 12288]

Each is timed by ``triton.testing.do_bench`` (median us; L2 flushed between runs) and
checked bit for bit against the two kernels. Writes $OUT/swiglu_fp8.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from triton.testing import do_bench

from trio_llm.gpu.kernels import fp8_gemm, triton_layers

CHUNKS = [1024, 2048, 4096, 8192, 16384]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=12288)
    args = parser.parse_args()
    gate_up = torch.randn(args.rows, 2 * args.intermediate, device="cuda",
                          dtype=torch.bfloat16)
    values, scales = fp8_gemm.quantize_groups(triton_layers.silu_and_mul(gate_up))
    results: dict[str, object] = {"rows": args.rows, "intermediate": args.intermediate}
    results["two kernels"] = do_bench(
        lambda: fp8_gemm.quantize_groups(triton_layers.silu_and_mul(gate_up))) * 1000
    default_chunk = triton_layers.SILU_FP8_BLOCK
    for chunk in CHUNKS:
        triton_layers.SILU_FP8_BLOCK = chunk
        activation = triton_layers.silu_and_mul_fp8(gate_up)
        assert torch.equal(activation.values.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(activation.scales, scales)
        block, warps = triton_layers.silu_fp8_launch(args.intermediate)
        results[f"one kernel, chunk {block}, {warps} warps"] = do_bench(
            lambda: triton_layers.silu_and_mul_fp8(gate_up)) * 1000
    triton_layers.SILU_FP8_BLOCK = default_chunk
    print(json.dumps(results, indent=1), flush=True)
    Path(os.environ.get("OUT", "."), "swiglu_fp8.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
