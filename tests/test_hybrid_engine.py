"""A hybrid model (built-in ``qwen3.5-small``: Gated DeltaNet linear attention beside
gated full attention, dummy weights) through the whole engine on the CPU: each
running request holds a state slot, and its tokens are the same alone or batched,
at depth 1 or 2, in small chunks (or a prompt's chunks capped), preempted
(recomputed in another slot) or not.

Prefix caching stays off: reusing a cached prefix needs the prefix's state
snapshot (the hybrid-engine scheduler's work); without one the executor refuses
the step rather than continue from another request's state."""

from __future__ import annotations

import random

import pytest
import trio
from msgspec.structs import replace
from test_engine_exactness import make_workload, run_alone, run_together
from test_scheduler import Driver, assert_reference_outputs, config, random_workload

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.scheduler import Scheduler

NUM_REQUESTS = 10
TIMEOUT = 600
AMPLE = EngineConfig(model="qwen3.5-small", load_format="dummy", num_kv_blocks=512,
                     block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                     enable_prefix_caching=False)
# 40 blocks of 4 tokens: far less than the requests need at once
TIGHT = replace(AMPLE, num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
async def test_same_tokens_under_every_batching(kv_cache_dtype) -> None:
    """(fp8: the attention layers' keys and values in e4m3, --kv-cache-dtype fp8)"""
    workload = make_workload(sampled=False)[:NUM_REQUESTS]
    ample = replace(AMPLE, kv_cache_dtype=kv_cache_dtype)
    with trio.fail_after(TIMEOUT):
        reference = await run_alone(replace(ample, pipeline_depth=1), workload)
        assert all(reference)
        variants = {"together, depth 2": ample,
                    "together, small chunks, depth 1": replace(
                        ample, max_num_batched_tokens=37, pipeline_depth=1),
                    "together, long prefills capped": replace(
                        ample, long_prefill_token_threshold=7)}
        for name, config in variants.items():
            results, _ = await run_together(config, workload)
            assert results == reference, name
        results, num_preemptions = await run_together(
            replace(TIGHT, kv_cache_dtype=kv_cache_dtype), workload)
        assert num_preemptions > 0, "the small KV cache forced preemption"
        assert results == reference, "preempted"


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_each_running_request_holds_its_own_state_slot(pipeline_depth):
    """The scheduler's slots (actors/state_slots.py) over a workload with priorities
    and a KV cache small enough to preempt: a request admitted (or re-admitted) takes a
    slot no running request holds, one of 0..max_num_seqs-1 (no snapshot slots here),
    and gives it back when it leaves; at the end every slot is free."""
    requests = random_workload(random.Random(3), 32, num_priorities=3)
    engine_config = config(pipeline_depth=pipeline_depth, scheduling_policy="priority")
    driver = Driver(engine_config, num_kv_blocks=16)
    driver.scheduler = Scheduler(engine_config, 16, num_state_slots=8)
    held: dict[str, int] = {}
    plan = driver.plan

    def checked_plan():
        batch = plan()
        if batch is not None:
            for request_id in batch.finished_request_ids:
                held.pop(request_id, None)
            for new_request in batch.new_requests:
                assert new_request.state_slot is not None
                assert 0 <= new_request.state_slot < 8
                assert new_request.state_slot not in held.values()
                held[new_request.request_id] = new_request.state_slot
        return batch

    driver.plan = checked_plan  # type: ignore[method-assign]
    driver.submit(*requests)
    driver.run()
    assert_reference_outputs(driver, requests)
    assert driver.scheduler.statistics().num_preemptions > 0
    statistics = driver.scheduler.statistics()
    assert statistics.num_free_state_slots == statistics.num_total_state_slots == 8
