"""The CPU forward's two hot spots alone, one layer of the issue 15 model, best of N.

    python benchmarks/cpu_attention_bench.py

attention: the CPU kernel (gpu/kernels/cpu_attention.py) against the float64 reference it
replaced as the CPU default and the float32 torch reference, on a decode step (64
sequences, contexts 100..380) and a prefill step (32 sequences of 32..256 tokens),
blocks shuffled over a 1,100-block cache, at 1 and 2 torch threads.
linear: `chunked_linear` (32-row chunks in one batched GEMM) against a loop of
`F.linear` over the same chunks and one plain `F.linear`, at 64 and 8,192 rows.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trio_llm.gpu import attention
from trio_llm.gpu.kernels import cpu_attention
from trio_llm.gpu.layers.linear import INVARIANT_ROWS_PER_CHUNK, chunked_linear

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 1100, 16, 4, 32, 8


def best_ms(function: Callable[[], object], repeats: int) -> float:
    function()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def attention_step(lengths: list[int], num_queries: list[int], seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(NUM_BLOCKS, generator=generator)
    width = max(-(-length // BLOCK_SIZE) for length in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for index, length in enumerate(lengths):
        count = -(-length // BLOCK_SIZE)
        tables[index, :count] = order[torch.arange(used, used + count) % NUM_BLOCKS]
        used += count
    query = torch.randn(sum(num_queries), NUM_HEADS, HEAD_DIM, generator=generator)
    starts = torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()], dtype=torch.int32)
    return query, tables, torch.tensor(lengths, dtype=torch.int32), starts


def bench_attention(repeats: int) -> dict[str, float]:
    rng = random.Random(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape), torch.randn(shape)
    decode_lengths = [rng.randint(100, 380) for _ in range(64)]
    prefill_lengths = [rng.randint(32, 256) for _ in range(32)]
    steps = {"decode": attention_step(decode_lengths, [1] * 64, 1),
             "prefill": attention_step(prefill_lengths, prefill_lengths, 2)}
    functions = {"cpu kernel": cpu_attention.paged_attention,
                 "float64 reference": attention.float64_paged_attention,
                 "float32 reference": attention.paged_attention}
    results = {}
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        for step_name, (query, tables, lens, starts) in steps.items():
            for name, function in functions.items():
                def run(function=function, query=query, tables=tables, lens=lens,
                        starts=starts) -> object:
                    return function(query, k_cache, v_cache, tables, lens, starts,
                                    HEAD_DIM**-0.5)
                slow = name != "cpu kernel"
                results[f"attention {step_name} {name} threads={num_threads} ms"] = round(
                    best_ms(run, 2 if slow else repeats), 2)
    return results


def bench_linear(repeats: int) -> dict[str, float]:
    torch.set_num_threads(1)
    results = {}
    for in_features, out_features in ((256, 1024), (512, 256)):
        weight = torch.randn(out_features, in_features)
        for num_rows in (64, 8192):
            x = torch.randn(num_rows, in_features)

            def looped(x=x, weight=weight) -> object:
                return torch.cat([F.linear(chunk, weight)
                                  for chunk in x.split(INVARIANT_ROWS_PER_CHUNK)])

            candidates = {"chunked_linear": lambda x=x, weight=weight: chunked_linear(
                              x, weight, None, INVARIANT_ROWS_PER_CHUNK),
                          "loop of F.linear": looped,
                          "plain F.linear (not invariant)": lambda x=x, weight=weight:
                              F.linear(x, weight)}
            for name, function in candidates.items():
                key = f"linear {in_features}->{out_features} rows={num_rows} {name} ms"
                results[key] = round(best_ms(function, repeats), 3)
    return results


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    print(json.dumps(bench_attention(repeats) | bench_linear(repeats), indent=2))


if __name__ == "__main__":
    main()
