"""Exactness gates: a request yields the same tokens whatever else runs.

32 requests of mixed prompt and output lengths, greedy and seeded-sampled,
compared token for token across: each alone vs all together, fcfs vs
priority, depth 1 vs depth 2, ample KV cache vs one so small that requests are
preempted and recomputed.
"""

from __future__ import annotations

import random

import pytest
import trio
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine

NUM_REQUESTS = 32
VOCAB_LIMIT = 1000  # the tiny model's vocabulary is larger; stay clear of special ids


def make_workload(*, sampled: bool) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt token ids, params, priority) for each request, from a fixed seed."""
    rng = random.Random(1234 if sampled else 4321)
    workload = []
    for index in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, VOCAB_LIMIT) for _ in range(rng.randint(1, 90))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 40),
            temperature=0.8 if sampled else 0.0,
            top_p=0.9 if sampled and index % 2 else 1.0,
            top_k=20 if sampled and index % 3 == 0 else 0,
            seed=index if sampled else None,
            ignore_eos=index % 2 == 0,
        )
        workload.append((prompt, params, rng.randint(0, 3)))
    return workload


async def collect(engine: Engine, prompt: list[int], params: SamplingParams,
                  priority: int) -> list[int]:
    token_ids: list[int] = []
    if engine.config.scheduling_policy != "priority":
        priority = 0  # fcfs refuses any other
    async for output in engine.generate(prompt, params, priority=priority):
        token_ids += output.token_ids
    return token_ids


async def run_together(config: EngineConfig, workload) -> tuple[list[list[int]], int]:
    results: list[list[int]] = [[] for _ in workload]
    async with Engine.open(config) as engine:

        async def one(index: int) -> None:
            results[index] = await collect(engine, *workload[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(workload)):
                nursery.start_soon(one, index)
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_total_blocks
    return results, stats.num_preemptions


async def run_alone(config: EngineConfig, workload) -> list[list[int]]:
    async with Engine.open(config) as engine:
        return [await collect(engine, *item) for item in workload]


AMPLE = EngineConfig(model="tiny", num_kv_blocks=512, block_size=16, max_num_seqs=64,
                     max_num_batched_tokens=256)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_same_tokens_under_every_batching(sampled: bool) -> None:
    workload = make_workload(sampled=sampled)
    with trio.fail_after(300):
        reference = await run_alone(replace(AMPLE, pipeline_depth=1), workload)
        assert all(reference), "every request produced output"

        variants = {
            "together, fcfs, depth 2": AMPLE,
            "together, fcfs, depth 1": replace(AMPLE, pipeline_depth=1),
            "together, priority, depth 2": replace(AMPLE, scheduling_policy="priority"),
            "together, small chunks": replace(AMPLE, max_num_batched_tokens=37),
            "together, long prefills capped": replace(AMPLE, long_prefill_token_threshold=7),
        }
        for name, config in variants.items():
            results, _ = await run_together(config, workload)
            assert results == reference, name

        # 40 blocks of 4 tokens: far less than 32 requests need at once.
        tight = EngineConfig(model="tiny", num_kv_blocks=40, block_size=4, max_num_seqs=32,
                             max_num_batched_tokens=64, scheduling_policy="priority")
        for depth in (2, 1):
            results, num_preemptions = await run_together(
                replace(tight, pipeline_depth=depth), workload)
            assert num_preemptions > 0, "the small KV cache forced preemption"
            assert results == reference, f"preempted, depth {depth}"
