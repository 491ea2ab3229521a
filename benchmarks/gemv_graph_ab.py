"""Decode-step graph replay with each GEMV rule against cuBLAS (device time, in the graph).

    python3 benchmarks/gemv_graph_ab.py [--models qwen3-8b qwen3-0.6b]

Isolated kernel timings (gemv_bench.py) include launch and cache effects that a
captured decode step does not have; this captures the real batch-1 and batch-8
decode graphs under each rule and times their replay. Writes $OUT/gemv_graph_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import gpu_bench  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import torch

from trio_llm.gpu import cuda_startup
from trio_llm.gpu.kernels import triton_gemv
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.models import cuda_fused

MIB = 2**20


def rule_forward(rule: str):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight_bytes = self.weight.numel() * self.weight.element_size()
        use = x.dim() == 2 and x.shape[0] <= triton_gemv.MAX_GEMV_ROWS
        if rule == "cublas" or (rule.startswith("small") and weight_bytes > 32 * MIB):
            use = False
        if not use:
            return Linear.forward(self, x)
        candidate = "direct" if rule.startswith("small") else rule
        config = triton_gemv.gemv_config(self.weight.shape[0], self.weight.shape[1], candidate)
        return triton_gemv.gemv(x, self.weight, self.bias, config=config)
    return forward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-0.6b"])
    args = parser.parse_args()
    results = {}
    for model in args.models:
        config = gpu_bench.engine_config(model, depth=2, max_num_seqs=8, num_kv_blocks=1024,
                                         max_model_len=4096)
        executor = gpu_bench.create_executor(config)
        for rule in ("cublas", "direct", "direct_512", "pipelined", "one_output", "small"):
            cuda_fused.GemvLinear.forward = rule_forward(rule)
            executor.graphs.clear()
            cuda_startup.capture_graphs(executor)
            for batch in (1, 2, 4, 8):
                ms = gpu_bench.graph_replay_ms(executor, batch)
                results[f"{model} {rule} batch {batch}"] = ms
                print(f"{model:11s} {rule:11s} batch {batch}: {ms:.3f} ms", flush=True)
        del executor
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", ".")) / "gemv_graph_ab.json"
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
