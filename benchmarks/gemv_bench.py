"""Time gpu/kernels/triton_gemv.py's candidates against cuBLAS on the device; write
$OUT/gemv_bench.json.

    python3 benchmarks/gemv_bench.py

For every linear layer of qwen3-8b and qwen3-0.6b at 1, 2, 4 and 8 rows, each
candidate configuration of ``gemv`` is first checked (relative error against
float32 ``F.linear``, row i bitwise equal whatever the row count, the same bits
run to run), then timed with ``triton.testing.do_bench`` (median; it flushes L2
between runs, so the weights come from memory as in a real decode step) next to
``F.linear``. GB/s counts the weight bytes once; the copy bandwidth (bytes read
plus written) is the ceiling. A case that fails is recorded and the rest go on.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from trio_llm.gpu.kernels import triton_gemv

# (N, K) of each linear layer: nn.Linear's [out_features, in_features].
SHAPES = {
    "qwen3-8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
                 "down": (4096, 12288), "lm_head": (151936, 4096)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
                   "down": (1024, 3072), "lm_head": (151936, 1024)},
}
NUM_LAYERS = {"qwen3-8b": 36, "qwen3-0.6b": 28}
ROW_COUNTS = (1, 2, 4, 8)
KERNELS = ["cublas"] + [f"gemv:{name}" for name in triton_gemv.CANDIDATES]


def environment() -> dict:
    properties = torch.cuda.get_device_properties(0)
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "triton": triton.__version__, "device": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda, "num_sms": properties.multi_processor_count,
            "default_candidate": triton_gemv.DEFAULT_CANDIDATE}


def copy_bandwidth_gbps() -> float:
    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * 2 * 1024**3 / (ms * 1e-3) / 1e9


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def check_candidate(config, x, weight, expected) -> dict:
    """Accuracy, batch invariance and run-to-run determinism at every row count."""
    full = triton_gemv.gemv(x, weight, config=config)
    checks = {"relative_error": relative_error(full, expected),
              "deterministic": torch.equal(full, triton_gemv.gemv(x, weight, config=config)),
              "batch_invariant": all(
                  torch.equal(triton_gemv.gemv(x[:num_rows], weight, config=config),
                              full[:num_rows])
                  for num_rows in ROW_COUNTS)}
    return checks


def time_kernel(kernel: str, x: torch.Tensor, weight: torch.Tensor) -> dict:
    if kernel == "cublas":
        run = lambda: F.linear(x, weight)  # noqa: E731
        record: dict = {}
    else:
        config = triton_gemv.gemv_config(*weight.shape, kernel.removeprefix("gemv:"))
        run = lambda: triton_gemv.gemv(x, weight, config=config)  # noqa: E731
        record = {"config": {"block_n": config.block_n, "block_k": config.block_k,
                             "num_warps": config.num_warps, "num_stages": config.num_stages}}
    ms = do_bench(run, warmup=10, rep=50, return_mode="median")
    record.update(us=ms * 1e3, gbps=weight.numel() * weight.element_size() / (ms * 1e-3) / 1e9)
    return record


def bench_shape(model: str, layer: str, num_outputs: int, num_inputs: int,
                copy_gbps: float) -> list[dict]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(num_outputs, num_inputs, generator=generator, device="cuda",
                         dtype=torch.bfloat16) * 0.02
    x = torch.randn(max(ROW_COUNTS), num_inputs, generator=generator, device="cuda",
                    dtype=torch.bfloat16)
    expected = F.linear(x.float(), weight.float())
    checks = {}
    for kernel in KERNELS[1:]:
        try:
            config = triton_gemv.gemv_config(num_outputs, num_inputs, kernel.removeprefix("gemv:"))
            checks[kernel] = check_candidate(config, x, weight, expected)
        except Exception as error:  # one broken candidate must not stop the others
            checks[kernel] = {"error": failure(error)}
    records = []
    for num_rows in ROW_COUNTS:
        for kernel in KERNELS:
            record = {"model": model, "layer": layer, "n": num_outputs, "k": num_inputs,
                      "rows": num_rows, "kernel": kernel, **checks.get(kernel, {})}
            if "error" not in record:
                try:
                    record.update(time_kernel(kernel, x[:num_rows], weight))
                    record["fraction_of_copy_bandwidth"] = record["gbps"] / copy_gbps
                except Exception as error:
                    record["error"] = failure(error)
            records.append(record)
    return records


def failure(error: Exception) -> str:
    traceback.print_exc()
    return f"{type(error).__name__}: {error}"[:500]


def print_table(records: list[dict]) -> None:
    print(f"\n{'model':11} {'layer':8} {'rows':>4} " + " ".join(f"{k:>22}" for k in KERNELS))
    cases: dict[tuple, dict[str, dict]] = {}
    for record in records:
        if "rows" not in record:  # the shape failed before any timing
            continue
        key = (record["model"], record["layer"], record["rows"])
        cases.setdefault(key, {})[record["kernel"]] = record
    for (model, layer, rows), by_kernel in cases.items():
        cells = []
        for kernel in KERNELS:
            record = by_kernel.get(kernel, {})
            if "us" in record:
                flag = "" if record.get("batch_invariant", True) else "!"
                cells.append(f"{record['us']:8.1f}us {record['gbps']:6.0f}GB/s{flag:1}")
            else:
                cells.append(f"{'failed':>22}")
        print(f"{model:11} {layer:8} {rows:4} " + " ".join(f"{c:>22}" for c in cells))


def summarize(records: list[dict]) -> dict:
    """Per model, row count and kernel: the linear layers' time for one decode step,
    and the geometric-mean speedup over cuBLAS across the layers."""
    summary: dict = {}
    for model, layers in SHAPES.items():
        for num_rows in ROW_COUNTS:
            timed = {(r["layer"], r["kernel"]): r["us"] for r in records
                     if r["model"] == model and r.get("rows") == num_rows and "us" in r}
            for kernel in KERNELS:
                if not all((layer, kernel) in timed for layer in layers):
                    continue
                step_us = timed[("lm_head", kernel)] + NUM_LAYERS[model] * sum(
                    timed[(layer, kernel)] for layer in layers if layer != "lm_head")
                speedups = [timed[(layer, "cublas")] / timed[(layer, kernel)]
                            for layer in layers if (layer, "cublas") in timed]
                summary[f"{model} rows={num_rows} {kernel}"] = {
                    "step_linear_us": step_us,
                    "geomean_speedup_over_cublas": math.exp(
                        sum(map(math.log, speedups)) / len(speedups)) if speedups else None}
    return summary


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gemv_bench needs a CUDA device")
    out_path = Path(os.environ.get("OUT", ".")) / "gemv_bench.json"
    results: dict = {"environment": environment(), "copy_bandwidth_gbps": copy_bandwidth_gbps(),
                     "records": []}
    print(json.dumps(results, indent=1))
    for model, layers in SHAPES.items():
        for layer, (num_outputs, num_inputs) in layers.items():
            try:
                results["records"] += bench_shape(model, layer, num_outputs, num_inputs,
                                                  results["copy_bandwidth_gbps"])
            except Exception as error:
                results["records"].append({"model": model, "layer": layer,
                                           "error": failure(error)})
            torch.cuda.empty_cache()
            out_path.write_text(json.dumps(results, indent=2))  # what a timeout leaves
    results["summary"] = summarize(results["records"])
    out_path.write_text(json.dumps(results, indent=2))
    print_table(results["records"])
    print("\nlinear layers per decode step (us) and geomean speedup over cuBLAS:")
    for name, entry in results["summary"].items():
        speedup = entry["geomean_speedup_over_cublas"]
        print(f"  {name:40} {entry['step_linear_us']:9.1f} us  x{speedup or math.nan:.3f}")
    failures = [r for r in results["records"] if "error" in r or
                r.get("batch_invariant") is False or r.get("deterministic") is False]
    print(f"\n{len(failures)} failed, not batch-invariant or not deterministic records")


if __name__ == "__main__":
    main()
