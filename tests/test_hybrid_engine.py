"""A hybrid model (built-in ``qwen3.5-small``: Gated DeltaNet linear attention beside
gated full attention, dummy weights) through the whole engine on the CPU: each
running request holds a state slot, and its tokens are the same alone or batched,
at depth 1 or 2, in small chunks, preempted (recomputed in another slot) or not.

Prefix caching stays off: reusing a cached prefix needs the prefix's state
snapshot (the hybrid-engine scheduler's work); without one the executor refuses
the step rather than continue from another request's state."""

from __future__ import annotations

import trio
from msgspec.structs import replace
from test_engine_exactness import make_workload, run_alone, run_together

from trio_llm.actors.config import EngineConfig

NUM_REQUESTS = 10
TIMEOUT = 600
AMPLE = EngineConfig(model="qwen3.5-small", load_format="dummy", num_kv_blocks=512,
                     block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                     enable_prefix_caching=False)
# 40 blocks of 4 tokens: far less than the requests need at once
TIGHT = replace(AMPLE, num_kv_blocks=40, block_size=4, max_num_batched_tokens=64)


async def test_same_tokens_under_every_batching() -> None:
    workload = make_workload(sampled=False)[:NUM_REQUESTS]
    with trio.fail_after(TIMEOUT):
        reference = await run_alone(replace(AMPLE, pipeline_depth=1), workload)
        assert all(reference)
        variants = {"together, depth 2": AMPLE,
                    "together, small chunks, depth 1": replace(
                        AMPLE, max_num_batched_tokens=37, pipeline_depth=1)}
        for name, config in variants.items():
            results, _ = await run_together(config, workload)
            assert results == reference, name
        results, num_preemptions = await run_together(TIGHT, workload)
        assert num_preemptions > 0, "the small KV cache forced preemption"
        assert results == reference, "preempted"
