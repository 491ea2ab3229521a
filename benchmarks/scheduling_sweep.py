"""Issue 10's qwen3-8b workload in-process, under several scheduler settings, on one
loaded executor (one model load for every variant).

    python3 benchmarks/scheduling_sweep.py --model qwen3-8b --budgets 8192 16384 4096 2048

The workload is `trio-llm bench serve`'s: ``--num-prompts`` requests of
``--input-len`` random token ids and ``--output-len`` output tokens (ignore_eos,
greedy), at most ``--concurrency`` at a time (a closed loop: each finished request
lets the next one start), timed as bench serve times them: TTFT from the submit to
the first token, TPOT over the tokens after it. It runs in-process (the facade's
streams, no HTTP): on this workload the one-process server and the served layout gave
the same figures (docs/performance.md, (g)), so the engine's scheduling sets them.

First, the floor: the first ``--concurrency`` prompts submitted at once with one
output token each (time to the last first token: the prefill of the first wave
alone, and the FLOP rate it implies), then the same wave with every output token
(the decode steps' time once all have prefilled). Then each budget
(``max_num_batched_tokens``) in turn. The executor is built for the largest budget;
each engine over it plans with its own. Each phase's figures go to
``$OUT/scheduling-sweep-MODEL.json`` as it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import _drain, create_executor, engine_config  # noqa: E402

from trio_llm.actors.messages import SamplingParams  # noqa: E402
from trio_llm.api.engine import Engine  # noqa: E402
from trio_llm.gpu.models.config import MoeConfig  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))


def linear_flops_per_token(executor: Any) -> float:
    """2 x the weights every token multiplies (embedding lookup and lm_head left out:
    a prompt's lm_head runs for its last token only)."""
    config = executor.model.config
    hidden = config.hidden_size
    attention = hidden * (config.q_size + 2 * config.kv_size) + config.q_size * hidden

    def feed_forward(index: int) -> int:
        """An MoE layer's active weights: its top-k experts and a shared expert."""
        if not (isinstance(config, MoeConfig) and config.is_moe_layer(index)):
            return 3 * hidden * config.intermediate_size
        return 3 * hidden * (config.num_experts_per_tok * config.moe_intermediate_size
                             + config.shared_expert_intermediate_size) + hidden * config.num_experts

    return 2.0 * sum(attention + feed_forward(index) for index in range(config.num_layers))


def attention_flops(executor: Any, prompt_len: int) -> float:
    """Causal attention of one prompt: QK^T and PV over the positions up to each token."""
    config = executor.model.config
    return 2.0 * 2.0 * config.q_size * (prompt_len * (prompt_len + 1) / 2) * config.num_layers


def random_prompts(seed: int, num_prompts: int, prompt_len: int, vocab: int) -> list[list[int]]:
    """Random ids (bench serve's random dataset); a seed of its own per phase, so no
    phase finds another's prompts in the prefix cache."""
    import random

    draw = random.Random(seed)
    return [[draw.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    position = share * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(ttfts: list[float], tpots: list[float], elapsed: float,
            num_output_tokens: int) -> dict[str, Any]:
    return {
        "elapsed_seconds": elapsed,
        "output_tokens_per_second": num_output_tokens / elapsed,
        "ttft_ms": {"median": 1000 * statistics.median(ttfts),
                    "p99": 1000 * percentile(ttfts, 0.99), "max": 1000 * max(ttfts)},
        "tpot_ms": {"median": 1000 * statistics.median(tpots) if tpots else None,
                    "p99": 1000 * percentile(tpots, 0.99) if tpots else None},
    }


async def closed_loop(config: Any, executor: Any, prompts: list[list[int]], output_len: int,
                      concurrency: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    tpots: list[float] = []
    first_token_at: list[float] = []
    num_output_tokens = 0
    next_index = 0
    _drain(executor)
    async with Engine.open(config, executor=executor) as engine:
        start = time.perf_counter()

        async def worker() -> None:
            nonlocal next_index, num_output_tokens
            while next_index < len(prompts):
                prompt = prompts[next_index]
                next_index += 1
                submitted = time.perf_counter()
                first = last = 0.0
                num_tokens = 0
                async for output in engine.generate(prompt, params):
                    now = time.perf_counter()
                    if num_tokens == 0:
                        first = now
                    last = now
                    num_tokens += len(output.token_ids)
                ttfts.append(first - submitted)
                first_token_at.append(first - start)
                if num_tokens > 1:
                    tpots.append((last - first) / (num_tokens - 1))
                num_output_tokens += num_tokens

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - start
        stats = engine.statistics()
    result = summary(ttfts, tpots, elapsed, num_output_tokens)
    result.update(num_steps=stats.num_steps, num_preemptions=stats.num_preemptions,
                  last_first_token_seconds=max(first_token_at))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8192, 16384, 4096, 2048])
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    args = parser.parse_args()
    quantization = {"quantization": args.quantization} if args.quantization else {}
    results: dict[str, Any] = {"model": args.model, "command": " ".join(["python3", *sys.argv]),
                               "date": time.strftime("%Y-%m-%d %H:%M"), "phases": {}}
    name = args.model + (f"-{args.quantization}" if args.quantization else "")
    path = OUT / f"scheduling-sweep-{name}.json"

    def record(name: str, figures: dict[str, Any]) -> None:
        results["phases"][name] = figures
        print(name, json.dumps(figures), flush=True)
        path.write_text(json.dumps(results, indent=1))

    started = time.perf_counter()
    executor = create_executor(engine_config(args.model, depth=2, **quantization,
                                             max_num_batched_tokens=max(args.budgets)))
    results["start_up_seconds"] = time.perf_counter() - started
    vocab = min(10000, executor.vocab_size)
    flops = (linear_flops_per_token(executor) * args.input_len
             + attention_flops(executor, args.input_len))
    results["prefill_gflop_per_prompt"] = flops / 1e9

    def prompts(seed: int, num_prompts: int = args.num_prompts) -> list[list[int]]:
        return random_prompts(seed, num_prompts, args.input_len, vocab)

    default = engine_config(args.model, depth=2, **quantization)
    # untimed warm-up: first uses of kernels and allocator sizes
    trio.run(closed_loop, default, executor, prompts(1, 16), 8, 16)
    first_wave = trio.run(closed_loop, default, executor, prompts(2, args.concurrency), 1,
                          args.concurrency)
    first_wave["prefill_tflop_per_second"] = (
        args.concurrency * flops / first_wave["last_first_token_seconds"] / 1e12)
    record("first_wave_prefill_only", first_wave)
    whole_wave = trio.run(closed_loop, default, executor, prompts(3, args.concurrency),
                          args.output_len, args.concurrency)
    whole_wave["decode_ms_per_step_after_prefill"] = 1000 * (
        whole_wave["elapsed_seconds"] - whole_wave["last_first_token_seconds"]) / (
        args.output_len - 1)
    record("first_wave_whole", whole_wave)
    for index, budget in enumerate(args.budgets):
        config = engine_config(args.model, depth=2, **quantization, max_num_batched_tokens=budget)
        record(f"budget_{budget}", trio.run(closed_loop, config, executor,
                                            prompts(10 + index), args.output_len,
                                            args.concurrency))
    results["wall_seconds"] = time.perf_counter() - started
    path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
