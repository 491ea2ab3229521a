"""The first workload of issue 15 through the engine: this tree's CPU path against an
earlier commit's, interleaved in one process.

    python benchmarks/cpu_engine_ab.py --baseline 366b21e --rounds 3

The baseline is rebuilt from that commit's gpu/cpu_attention.py (read with
`git show`) as the attention backend of the plain CausalLM, one torch thread: the
CPU forward as it was before gpu/cpu_layers.py, where gpu/layers.py and
gpu/model.py are unchanged since. Contenders in every round, in this order: the
baseline, this tree at 1 forward thread, this tree at 2. Figures: output tok/s
(wall) and output tokens per CPU second of the process (all threads: less
disturbed by other load), with the load average at each run's start; the greedy
tokens of every contender are compared with the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.attention import AttentionBackend
from trio_llm.gpu.model import CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from cpu_bench import build_small_model, run_engine, workload  # noqa: E402


def baseline_backend(commit: str) -> AttentionBackend:
    """The attention backend of ``commit``'s gpu/cpu_attention.py, as a module of its own."""
    source = subprocess.run(["git", "show", f"{commit}:gpu/cpu_attention.py"], check=True,
                            capture_output=True, text=True,
                            cwd=Path(__file__).parent.parent).stdout
    # numba caches on disk beside a module's file: this one has none
    source = source.replace("cache=True", "cache=False")
    module = types.ModuleType("baseline_cpu_attention")
    sys.modules[module.__name__] = module
    exec(compile(source, f"{commit}:gpu/cpu_attention.py", "exec"), module.__dict__)
    module.warm_up()
    return AttentionBackend("baseline", module.write_kv_cache, module.paged_attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default="366b21e")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    backend = baseline_backend(args.baseline)

    def as_baseline(executor: Any) -> None:
        executor.model.__class__ = CausalLM
        executor.model.attention_backend = backend
        torch.set_num_threads(1)

    items = workload("first", 0)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="cpu-ab-") as tmp:
        config = EngineConfig(model=str(build_small_model(Path(tmp))), device="cpu",
                              dtype="float32", num_kv_blocks=4096)
        for index in range(args.rounds):
            results = {}
            for name, threads, prepare in ((f"baseline {args.baseline}", "1", as_baseline),
                                           ("this tree, 1 thread", "1", None),
                                           ("this tree, 2 threads", "2", None)):
                os.environ["OMP_NUM_THREADS"] = threads
                torch.set_num_threads(int(threads))
                results[name] = run_engine(config, items, prepare)
            rounds.append(results)
            print(f"round {index + 1}: " + ", ".join(
                f"{name} {round(value['output_tokens_per_second'])} tok/s "
                f"({round(value['num_output_tokens'] / value['cpu_seconds'])} per CPU s, "
                f"load {value['load_average']:.1f})" for name, value in results.items()),
                file=sys.stderr, flush=True)
    baseline_name = f"baseline {args.baseline}"
    summary = {name: {"output_tokens_per_second": [round(r[name]["output_tokens_per_second"])
                                                   for r in rounds],
                      "output_tokens_per_cpu_second": [
                          round(r[name]["num_output_tokens"] / r[name]["cpu_seconds"])
                          for r in rounds],
                      "load_average": [round(r[name]["load_average"], 1) for r in rounds],
                      "greedy_tokens_equal_to_baseline": all(
                          r[name]["token_ids"] == r[baseline_name]["token_ids"] for r in rounds)}
               for name in rounds[0]}
    print(json.dumps(summary, indent=1))
    if args.json:
        for round_ in rounds:
            for value in round_.values():
                value.pop("token_ids", None)
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
