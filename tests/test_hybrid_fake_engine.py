"""The whole engine (intake, queue, scheduler, runner, detokenizer) over a fake executor
with a state cache, as a model with linear-attention layers has: state slots and
prefix-cache snapshots end to end, until a real hybrid model checks the same.

``StateHashExecutor`` keeps a state per slot: a hash of every token the slot's
request has been fed, and their number. It continues each request from its slot
(a request that starts from ``num_computed_tokens > 0`` reads the state the batch's
``state_copies`` restored, and the state must have seen exactly that many tokens),
runs the copies first, in order, and samples a token from the state alone. Any
wrong slot, stale snapshot or misordered copy changes the tokens.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
import trio.testing
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams, ScheduledBatch, StepResult
from trio_llm.api.engine import Engine, create_executor
from trio_llm.api.processes import open_served_layout

VOCAB_LIMIT = 1000  # the tiny model's tokenizer decodes these; clear of special ids
MODULUS = 2**61 - 1
NUM_SNAPSHOTS = 12

State = tuple[int, int]  # (hash of the tokens seen, how many)


def extended(state: State, token_id: int) -> State:
    return ((state[0] * 1_000_003 + token_id + 1) % MODULUS, state[1] + 1)


def sampled_from(state: State) -> int:
    return 3 + (state[0] * 2_654_435_761 >> 7) % (VOCAB_LIMIT - 3)


class StateHashExecutor:
    """The tiny model's sizes and tokenizer; a state cache of hashes for a model
    (see the module). Runs the engine's steps in order, as a device stream does."""

    def __init__(self, inner: Any, config: EngineConfig) -> None:
        self.model_path = inner.model_path
        self.max_model_len = inner.max_model_len
        self.num_kv_blocks = config.num_kv_blocks or inner.num_kv_blocks
        self.vocab_size = inner.vocab_size
        self.num_state_slots = config.max_num_seqs + NUM_SNAPSHOTS
        self.slot_states: dict[int, State] = {}
        self.request_slots: dict[str, int] = {}
        self.last_sampled: dict[str, int] = {}
        self.num_restored_tokens = 0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        for request_id in batch.finished_request_ids:
            del self.request_slots[request_id]
            self.last_sampled.pop(request_id, None)
        for source, destination in batch.state_copies:
            assert destination not in self.request_slots.values(), "a copy over a running slot"
            self.slot_states[destination] = self.slot_states[source]
        for new in batch.new_requests:
            assert new.state_slot is not None and new.state_slot not in self.request_slots.values()
            self.request_slots[new.request_id] = new.state_slot
        request_ids, sampled = [], []
        for scheduled in batch.requests:
            slot = self.request_slots[scheduled.request_id]
            state = self._state_before(scheduled, slot, batch)
            token_ids = (scheduled.token_ids if not scheduled.input_from_previous_step
                         else [self.last_sampled[scheduled.request_id]])
            for token_id in token_ids:
                state = extended(state, token_id)
            self.slot_states[slot] = state
            if scheduled.sample:
                token_id = sampled_from(state)
                self.last_sampled[scheduled.request_id] = token_id
                request_ids.append(scheduled.request_id)
                sampled.append(token_id)
        return StepResult(step_id=batch.step_id, request_ids=request_ids,
                          sampled_token_ids=sampled)

    def _state_before(self, scheduled: Any, slot: int, batch: ScheduledBatch) -> State:
        if scheduled.num_computed_tokens == 0:
            return (0, 0)
        state = self.slot_states[slot]
        assert state[1] == scheduled.num_computed_tokens, "the state does not match the position"
        if any(new.request_id == scheduled.request_id for new in batch.new_requests):
            self.num_restored_tokens += state[1]
        return state


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    state: State = (0, 0)
    for token_id in prompt:
        state = extended(state, token_id)
    output: list[int] = []
    while len(output) < max_tokens:
        output.append(sampled_from(state))
        state = extended(state, output[-1])
    return output


AMPLE = EngineConfig(model="tiny", device="cpu", num_kv_blocks=512, block_size=4,
                     max_num_seqs=16, max_num_batched_tokens=64)
# 40 blocks of 4 tokens: far less than the requests need at once.
TIGHT = replace(AMPLE, num_kv_blocks=40)


def shared_prefix_workload(num_requests: int = 24) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): prompts starting with one of three system prompts (or
    none), then their own tokens; every fourth repeats an earlier prompt exactly."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, VOCAB_LIMIT) for _ in range(length)] for length in (40, 21, 33)]
    workload: list[tuple[list[int], int]] = []
    for index in range(num_requests):
        if index % 4 == 3:
            prompt = workload[rng.randrange(index)][0]
        else:
            prompt = rng.choice([[], *prefixes]) + [rng.randrange(3, VOCAB_LIMIT)
                                                    for _ in range(rng.randint(1, 20))]
        workload.append((prompt, rng.randint(1, 16)))
    return workload


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def collect(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    token_ids: list[int] = []
    async for output in engine.generate(prompt, params(max_tokens)):
        token_ids += output.token_ids
    return token_ids


def assert_slots_free(engine: Engine) -> None:
    statistics = engine.statistics()
    assert statistics.num_running == 0
    assert statistics.num_free_blocks == statistics.num_total_blocks
    assert (statistics.num_free_state_slots + statistics.num_state_snapshots
            == statistics.num_total_state_slots > 0), "a state slot leaked"


@pytest.fixture(scope="module")
def tiny_executor() -> Any:
    return create_executor(AMPLE)


async def run_together(config: EngineConfig, workload: list[tuple[list[int], int]],
                       tiny: Any) -> tuple[list[list[int]], Any, StateHashExecutor]:
    executor = StateHashExecutor(tiny, config)
    results: list[list[int]] = [[] for _ in workload]
    async with Engine.open(config, executor=executor) as engine:

        async def one(index: int) -> None:
            results[index] = await collect(engine, *workload[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(workload)):
                nursery.start_soon(one, index)
        assert_slots_free(engine)
        statistics = engine.statistics()
    return results, statistics, executor


async def test_every_layout_of_the_steps_gives_the_reference_tokens(tiny_executor) -> None:
    workload = shared_prefix_workload()
    reference = [reference_output(prompt, max_tokens) for prompt, max_tokens in workload]
    with trio.fail_after(120):
        executor = StateHashExecutor(tiny_executor, AMPLE)
        async with Engine.open(AMPLE, executor=executor) as engine:
            alone = [await collect(engine, *item) for item in workload]
            assert_slots_free(engine)
        assert alone == reference
        assert executor.num_restored_tokens > 0, "repeated prompts start from snapshots"
        variants = {
            "depth 2": AMPLE,
            "depth 1": replace(AMPLE, pipeline_depth=1),
            "caching off": replace(AMPLE, enable_prefix_caching=False),
            "small chunks": replace(AMPLE, max_num_batched_tokens=13),
            "priority": replace(AMPLE, scheduling_policy="priority"),
        }
        for name, config in variants.items():
            results, statistics, executor = await run_together(config, workload, tiny_executor)
            assert results == reference, name
            if config.enable_prefix_caching:
                assert statistics.num_prefix_cache_hits > 0, name
            else:
                assert statistics.num_prefix_cache_hits == 0 == executor.num_restored_tokens


@pytest.mark.parametrize("pipeline_depth", [1, 2])
async def test_preempted_requests_recompute_the_reference_tokens(tiny_executor,
                                                                 pipeline_depth) -> None:
    workload = shared_prefix_workload()
    reference = [reference_output(prompt, max_tokens) for prompt, max_tokens in workload]
    with trio.fail_after(120):
        results, statistics, _ = await run_together(
            replace(TIGHT, pipeline_depth=pipeline_depth), workload, tiny_executor)
    assert statistics.num_preemptions > 0, "the small KV cache forced preemption"
    assert results == reference


async def test_leaving_a_stream_early_frees_its_slot(tiny_executor) -> None:
    with trio.fail_after(60):
        async with Engine.open(AMPLE, executor=StateHashExecutor(tiny_executor, AMPLE)) as engine:
            for index in range(4):
                async for _ in engine.generate([10 + index] * 9, params(50)):
                    break  # the caller leaves: the engine aborts the request
            async with trio.open_nursery() as nursery:
                nursery.start_soon(collect, engine, [11] * 9, 200)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()  # a caller cancelled mid-stream
            # Channels are FIFO: once one more request finished, the aborts were handled.
            assert await collect(engine, [5, 6, 7], 2) == reference_output([5, 6, 7], 2)
            assert_slots_free(engine)


async def test_two_api_servers_give_the_in_process_tokens(tiny_executor) -> None:
    """The served layout: the core's scheduler gets the executor's slots too."""
    workload = shared_prefix_workload()
    reference = [reference_output(prompt, max_tokens) for prompt, max_tokens in workload]
    executor = StateHashExecutor(tiny_executor, AMPLE)
    results: list[list[int]] = [[] for _ in workload]
    with trio.fail_after(120):
        async with open_served_layout(AMPLE, 2, executor=executor) as fronts:

            async def one(index: int) -> None:
                results[index] = await collect(fronts[index % 2], *workload[index])

            async with trio.open_nursery() as nursery:
                for index in range(len(workload)):
                    nursery.start_soon(one, index)
    assert results == reference
    assert executor.num_restored_tokens > 0
