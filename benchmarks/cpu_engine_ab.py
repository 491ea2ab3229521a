"""The first workload of issue 15 through the engine: CPU forwards of this tree against
each other (and against an earlier commit's), interleaved in one process.

    python benchmarks/cpu_engine_ab.py --rounds 3
    python benchmarks/cpu_engine_ab.py --baseline 366b21e --rounds 3

Contenders, in this order in every round: with ``--baseline``, the plain CausalLM with
that commit's gpu/kernels/cpu_attention.py (read with `git show`) as its attention backend,
one torch thread (the CPU forward before gpu/kernels/cpu_layers.py); this tree's fused model
with each part of a step in torch operations and one kernel call per fused op (the
CPU path of 90229a8), at 2 forward threads; this tree's default, each part of a step
in one compiled call (gpu/kernels/cpu_layers.py, ``_forward_layers``), at 1 and 2 threads.
Figures: output tok/s (wall) and output tokens per CPU second of the process (all
threads: less disturbed by other load), with the load average at each run's start;
the greedy tokens of every contender are compared with the first contender's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.attention import AttentionBackend
from trio_llm.gpu.models.base import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from cpu_bench import build_small_model, run_engine, workload  # noqa: E402


def baseline_backend(commit: str) -> AttentionBackend:
    """The attention backend of ``commit``'s gpu/kernels/cpu_attention.py (gpu/cpu_attention.py
    before the kernels moved), as a module of its own."""
    for path in ("gpu/kernels/cpu_attention.py", "gpu/cpu_attention.py"):
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], capture_output=True,
                               text=True, cwd=Path(__file__).parent.parent)
        if shown.returncode == 0:
            break
    shown.check_returncode()
    source = shown.stdout
    # numba caches on disk beside a module's file: this one has none
    source = source.replace("cache=True", "cache=False")
    module = types.ModuleType("baseline_cpu_attention")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{commit}:gpu/kernels/cpu_attention.py", "exec"), module.__dict__)
    module.warm_up()
    return AttentionBackend("baseline", module.write_kv_cache, module.paged_attention)


def in_torch_ops(executor: Any) -> None:
    """The fused model with each part in torch operations (sgemm_address 0)."""
    executor.model.sgemm_address = 0


def contenders(baseline: str | None) -> list[tuple[str, str, Callable[[Any], None] | None]]:
    """(name, OMP_NUM_THREADS, prepare) of each contender, in the order they run."""
    runs: list[tuple[str, str, Callable[[Any], None] | None]] = []
    if baseline:
        backend = baseline_backend(baseline)

        def as_baseline(executor: Any) -> None:
            executor.model.__class__ = CausalLM
            executor.model.attention_backend = backend
            torch.set_num_threads(1)

        runs.append((f"baseline {baseline}", "1", as_baseline))
    return runs + [("fused, in torch ops, 2 threads", "2", in_torch_ops),
                   ("compiled, 1 thread", "1", None), ("compiled, 2 threads", "2", None)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="an earlier commit's attention kernel, e.g. 366b21e")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    runs = contenders(args.baseline)
    items = workload("first", 0)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cpu-ab-") as tmp:
        config = EngineConfig(model=str(build_small_model(Path(tmp))), device="cpu",
                              dtype="float32", num_kv_blocks=4096)
        for index in range(args.rounds):
            results = {}
            for name, threads, prepare in runs:
                os.environ["OMP_NUM_THREADS"] = threads
                torch.set_num_threads(int(threads))
                results[name] = run_engine(config, items, prepare)
            rounds.append(results)
            print(f"round {index + 1}: " + ", ".join(
                f"{name} {round(value['output_tokens_per_second'])} tok/s "
                f"({round(value['num_output_tokens'] / value['cpu_seconds'])} per CPU s, "
                f"load {value['load_average']:.1f})" for name, value in results.items()),
                file=sys.stderr, flush=True)
    first_name = runs[0][0]
    summary = {name: {"output_tokens_per_second": [round(r[name]["output_tokens_per_second"])
                                                   for r in rounds],
                      "output_tokens_per_cpu_second": [
                          round(r[name]["num_output_tokens"] / r[name]["cpu_seconds"])
                          for r in rounds],
                      "load_average": [round(r[name]["load_average"], 1) for r in rounds],
                      f"greedy_tokens_equal_to {first_name}": all(
                          r[name]["token_ids"] == r[first_name]["token_ids"] for r in rounds)}
               for name in rounds[0]}
    print(json.dumps(summary, indent=1))
    if args.json:
        for round_ in rounds:
            for value in round_.values():
                value.pop("token_ids", None)
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
