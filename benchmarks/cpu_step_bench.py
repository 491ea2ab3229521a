"""One prefill step and one decode step of issue 15's model, plain against fused, on the CPU.

    python benchmarks/cpu_step_bench.py [--rounds 3]

The model is benchmarks/cpu_bench.py's small Qwen3 (float32). The prefill step
holds 57 prompts of 32..256 tokens (8,313 tokens: what the first workload's first
step prefills); the decode step 64 sequences with contexts 100..380. Contenders,
interleaved in every round: the plain CausalLM (torch operations, the CPU
attention kernel, one thread), the fused model of gpu/models/cpu_fused.py with each part
in torch operations at 1 and 2 forward threads, and the fused model's default, each
part in one compiled call, at 1 and 2 threads. Each figure is the best of the round's
repeats, in ms: wall time and the process's CPU time (all threads), the latter less
disturbed by other load.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trio_llm.gpu.kernels import cpu_layers
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.models import cpu_fused
from trio_llm.gpu.models.base import AttentionMetadata, CausalLM

sys.path.insert(0, str(Path(__file__).parent))
from cpu_bench import build_small_model  # noqa: E402

BLOCK_SIZE = 16
NUM_BLOCKS = 4096
Step = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]


def make_step(num_queries: list[int], context_lens: list[int], rng: random.Random) -> Step:
    """Token ids, positions, metadata and the rows to sample of one step; every sequence
    gets its own run of blocks."""
    token_ids, positions, slots, tables, starts = [], [], [], [], [0]
    next_block = 0
    for count, context_len in zip(num_queries, context_lens, strict=True):
        blocks = list(range(next_block, next_block + -(-context_len // BLOCK_SIZE)))
        next_block += len(blocks)
        for position in range(context_len - count, context_len):
            token_ids.append(rng.randrange(2048))
            positions.append(position)
            slots.append(blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE)
        tables.append(blocks)
        starts.append(len(token_ids))
    width = max(len(row) for row in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([row + [0] * (width - len(row)) for row in tables],
                                  dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32))
    return (torch.tensor(token_ids), torch.tensor(positions), metadata,
            torch.tensor(starts[1:]) - 1)


def run_step(model: CausalLM, caches: list, step: Step) -> torch.Tensor:
    token_ids, positions, metadata, sampled = step
    with torch.inference_mode():
        hidden = model(token_ids, positions, caches, metadata)
        return model.compute_logits(hidden[sampled]).argmax(-1)


def best_ms(function: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best wall ms, best process CPU ms) of ``repeats`` calls after one warm-up call."""
    function()
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        function()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return round(1000 * best_wall, 2), round(1000 * best_cpu, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompt_lens = [rng.randint(32, 256) for _ in range(57)]
    decode_lens = [rng.randint(100, 380) for _ in range(64)]
    steps = {"prefill": (make_step(prompt_lens, prompt_lens, rng), 2),
             "decode": (make_step([1] * 64, decode_lens, rng), 15)}
    with tempfile.TemporaryDirectory(prefix="cpu-step-") as tmp:
        model_dir = build_small_model(Path(tmp))
        model = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
        compiled = cpu_fused.fuse_model(load_model(model_dir, dtype=torch.float32,
                                                    device=torch.device("cpu")))
    model.attention_backend.warm_up()
    cpu_layers.warm_up()
    caches = model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    compiled_caches = compiled.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    contenders = {"plain": (model, CausalLM, 1),
                  "fused in torch ops, 1 thread": (model, cpu_fused.CpuFusedCausalLM, 1),
                  "fused in torch ops, 2 threads": (model, cpu_fused.CpuFusedCausalLM, 2),
                  "compiled, 1 thread": (compiled, cpu_fused.CpuFusedCausalLM, 1),
                  "compiled, 2 threads": (compiled, cpu_fused.CpuFusedCausalLM, 2)}
    results: dict[str, list] = {}
    for index in range(args.rounds):
        for name, (contender, model_class, num_parts) in contenders.items():
            contender.__class__ = model_class
            contender.num_parts = num_parts  # read by the fused forward only
            contender_caches = compiled_caches if contender is compiled else caches
            for step_name, (step, repeats) in steps.items():
                key = f"{step_name}, {name} (wall ms, CPU ms)"
                results.setdefault(key, []).append(
                    best_ms(lambda step=step, contender=contender, kv=contender_caches:
                            run_step(contender, kv, step), repeats))
        print(f"round {index + 1} done", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
