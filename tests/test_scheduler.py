"""The scheduler: policy tests driven without trio, then the actor with a fake runner.

The fake model checks the scheduler-runner protocol as it executes each batch
(positions, block tables, placeholders, who the runner must forget) and
samples a token from a hash of the request's whole context, its output index
and its seed. Any scheduling mistake that feeds the model a wrong token, a
wrong position or a wrong output index changes the output; ``reference_output``
computes what every request must produce, alone and unscheduled.

Its KV cache is real in one respect: every slot keeps the context hash before
and after its token, so a request that starts after a cached prefix continues
from what its blocks hold (a wrong or stale block changes its output), the
chain through its blocks is checked, and a block is written only by its one
holder.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import (
    Abort,
    AbortOutcome,
    Admit,
    Pull,
    Pulled,
    Request,
    RequestOutput,
    SamplingOptions,
    SamplingParams,
    ScheduledBatch,
    StepResult,
    StopStringHit,
    TokenBatch,
    Track,
    WaitingRequest,
)
from trio_llm.actors.queue import WaitingQueue, run_queue
from trio_llm.actors.scheduler import Scheduler, run_scheduler
from trio_llm.actors.streams import RequestStreams

VOCAB_SIZE = 64
HASH_MODULUS = 2**61 - 1


# -- a fake model and the reference it must match ---------------------------------------


def extend_hash(context_hash: int, token_id: int) -> int:
    return (context_hash * 1_000_003 + token_id + 1) % HASH_MODULUS


def fake_sample(context_hash: int, output_index: int, seed: int) -> int:
    mixed = (context_hash * 31 + output_index * 1_000_033 + seed * 7_919) % HASH_MODULUS
    return (mixed * 2_654_435_761 >> 11) % VOCAB_SIZE


def reference_output(request: Request) -> tuple[list[int], str, int | None]:
    """(output token ids, finish reason, stop reason) of a request run alone."""
    context_hash = 0
    for token_id in request.prompt_token_ids:
        context_hash = extend_hash(context_hash, token_id)
    output: list[int] = []
    while True:
        token_id = fake_sample(context_hash, len(output), request.sampling.seed)
        output.append(token_id)
        context_hash = extend_hash(context_hash, token_id)
        if token_id in request.stop_token_ids and len(output) > request.sampling.min_tokens:
            return output, "stop", token_id
        if len(output) >= request.max_tokens:
            return output, "length", None


class _FakeSequence:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.context_hash = 0
        self.num_tokens = 0
        self.block_ids: list[int] = []
        self.last_sampled: tuple[int, int] | None = None  # (step id, token id)


class FakeModel:
    """Executes batches as the runner would, asserting the protocol on the way.

    Requests run in batch order: a block a request reads from the cache was
    written in an earlier step or earlier in this batch (a real model writes
    every layer's KV before attending, so order does not matter there).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sequences: dict[str, _FakeSequence] = {}
        self.block_holders: dict[int, set[str]] = defaultdict(set)
        # block id -> per slot: (context hash before its token, after it)
        self.kv: dict[int, list[tuple[int, int] | None]] = {}
        self.next_step_id = 0
        self.batches: list[ScheduledBatch] = []
        self.num_cached_tokens_read = 0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        assert batch.step_id == self.next_step_id
        self.next_step_id += 1
        self.batches.append(batch)
        for request_id in batch.finished_request_ids:
            self._forget(request_id)
        for new_request in batch.new_requests:
            assert new_request.request_id not in self.sequences, "never told to forget it"
            self.sequences[new_request.request_id] = _FakeSequence(new_request.sampling.seed)
        request_ids, sampled_token_ids = [], []
        num_tokens = 0
        for scheduled in batch.requests:
            sequence = self.sequences[scheduled.request_id]
            token_ids = self._input_token_ids(sequence, scheduled, batch.step_id)
            self._extend_blocks(sequence, scheduled.request_id, scheduled.new_block_ids,
                                scheduled.num_computed_tokens)
            if sequence.num_tokens == 0 and scheduled.num_computed_tokens > 0:
                self._start_from_cache(sequence, scheduled.num_computed_tokens)
            assert scheduled.num_computed_tokens == sequence.num_tokens
            for token_id in token_ids:
                self._write(sequence, scheduled.request_id, token_id)
            num_tokens += len(token_ids)
            blocks_needed = -(-sequence.num_tokens // self.block_size)
            assert len(sequence.block_ids) == blocks_needed, "block table does not fit the tokens"
            if scheduled.sample:
                token_id = fake_sample(sequence.context_hash, scheduled.output_index, sequence.seed)
                sequence.last_sampled = (batch.step_id, token_id)
                request_ids.append(scheduled.request_id)
                sampled_token_ids.append(token_id)
        assert num_tokens == batch.num_tokens
        return StepResult(step_id=batch.step_id, request_ids=request_ids,
                          sampled_token_ids=sampled_token_ids)

    def _input_token_ids(self, sequence: _FakeSequence, scheduled: Any, step_id: int) -> list[int]:
        if not scheduled.input_from_previous_step:
            assert scheduled.token_ids
            return scheduled.token_ids
        assert scheduled.token_ids == []
        assert sequence.last_sampled is not None and sequence.last_sampled[0] == step_id - 1
        return [sequence.last_sampled[1]]

    def _extend_blocks(self, sequence: _FakeSequence, request_id: str,
                       new_block_ids: list[int], num_computed_tokens: int) -> None:
        """Blocks it will write must be its alone; blocks of a cached prefix
        (before ``num_computed_tokens`` on its first step) must be written."""
        for block_id in new_block_ids:
            start = len(sequence.block_ids) * self.block_size
            if start >= num_computed_tokens:
                assert not self.block_holders[block_id], f"block {block_id} is still in use"
            else:
                assert all(self.kv.get(block_id, [None])), f"cached block {block_id} is unwritten"
            self.block_holders[block_id].add(request_id)
            sequence.block_ids.append(block_id)

    def _start_from_cache(self, sequence: _FakeSequence, num_cached_tokens: int) -> None:
        """Continue from the cached prefix's KV, checking that its slots chain up."""
        assert num_cached_tokens % self.block_size == 0, "only full blocks are cached"
        context_hash = 0
        for position in range(num_cached_tokens):
            block_id = sequence.block_ids[position // self.block_size]
            slot = self.kv[block_id][position % self.block_size]
            assert slot is not None and slot[0] == context_hash, "cached blocks do not chain"
            context_hash = slot[1]
        sequence.context_hash = context_hash
        sequence.num_tokens = num_cached_tokens
        self.num_cached_tokens_read += num_cached_tokens

    def _write(self, sequence: _FakeSequence, request_id: str, token_id: int) -> None:
        position = sequence.num_tokens
        block_id = sequence.block_ids[position // self.block_size]
        assert self.block_holders[block_id] == {request_id}, f"block {block_id} is shared"
        before = sequence.context_hash
        sequence.context_hash = extend_hash(before, token_id)
        slots = self.kv.setdefault(block_id, [None] * self.block_size)
        if position % self.block_size == 0:
            slots[:] = [None] * self.block_size  # a new owner: old content is gone
        slots[position % self.block_size] = (before, sequence.context_hash)
        sequence.num_tokens += 1

    def _forget(self, request_id: str) -> None:
        sequence = self.sequences.pop(request_id, None)
        assert sequence is not None, f"told to forget {request_id!r}, which it never had"
        for block_id in sequence.block_ids:
            self.block_holders[block_id].discard(request_id)


def make_request(request_id: str, prompt_token_ids: list[int], *, max_tokens: int = 8,
                 priority: int = 0, arrival_index: int = 0, seed: int = 0,
                 stop_token_ids: list[int] | None = None, min_tokens: int = 0,
                 cache_salt: str | None = None) -> Request:
    sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
                               num_logprobs=None, min_tokens=min_tokens, banned_token_ids=[])
    return Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                   # (the scheduler reads min_tokens from sampling; SamplingParams
                   # refuses it over max_tokens)
                   params=SamplingParams(max_tokens=max_tokens,
                                         min_tokens=min(min_tokens, max_tokens)),
                   sampling=sampling, stop_token_ids=stop_token_ids or [], max_tokens=max_tokens,
                   priority=priority, arrival_index=arrival_index, arrival_time=0.0,
                   cache_salt=cache_salt)


def random_workload(rng: random.Random, num_requests: int, *, max_prompt_len: int = 40,
                    max_output_len: int = 24, num_priorities: int = 1,
                    shared_prefixes: list[list[int]] | None = None) -> list[Request]:
    """Random requests; with ``shared_prefixes``, each prompt starts with one of
    them (or none), then its own tokens."""
    prefixes = [[], *(shared_prefixes or [])]
    return [
        make_request(
            f"r{index}",
            rng.choice(prefixes)
            + [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, max_prompt_len))],
            max_tokens=rng.randint(1, max_output_len),
            priority=rng.randrange(num_priorities),
            arrival_index=index,
            seed=rng.randrange(1000),
            stop_token_ids=[0, 1] if index % 3 else [],
            min_tokens=rng.choice([0, 0, 2]),
        )
        for index in range(num_requests)
    ]


# -- the actor shells' loop, without trio ---------------------------------------------


class Driver:
    """Drives the queue and scheduler policies the way their actors do, and a
    FakeModel with up to the pipeline depth of batches in flight."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.queue = WaitingQueue(config)
        self.scheduler = Scheduler(config, num_kv_blocks)
        self.model = FakeModel(config.block_size)
        self.in_flight: deque[ScheduledBatch] = deque()
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.finishes: dict[str, tuple[str, int | None]] = {}
        self.tracked: set[str] = set()
        self.first_step: dict[str, int] = {}
        self.preempted: list[str] = []
        self.max_num_running = 0

    def submit(self, *requests: Request) -> None:
        for request in requests:
            assert self.queue.admit(request)

    def abort(self, request_id: str) -> None:
        if self.queue.abort(request_id):
            self._finish(request_id, ("abort", None))
            return
        tokens = self.scheduler.abort(request_id)
        if tokens is not None:
            self._receive(tokens)
        self.queue.forget_abort(request_id)

    def plan(self) -> ScheduledBatch | None:
        """Pull and plan one step (the scheduler must be able to plan)."""
        pulled = self._pull()
        plan = self.scheduler.schedule(pulled)
        for track in plan.tracks:
            assert track.request.request_id not in self.tracked
            self.tracked.add(track.request.request_id)
        if plan.requeue is not None:
            pulled_ids = {waiting.request.request_id for waiting in pulled}
            self.preempted += [waiting.request.request_id for waiting in plan.requeue.requests
                               if waiting.request.request_id not in pulled_ids]
            assert self.queue.requeue(plan.requeue.requests) == []
        if plan.batch is not None:
            self.in_flight.append(plan.batch)
            for scheduled in plan.batch.requests:
                self.first_step.setdefault(scheduled.request_id, plan.batch.step_id)
        self.max_num_running = max(self.max_num_running, self.scheduler.statistics().num_running)
        return plan.batch

    def complete(self) -> None:
        """The runner answers the oldest batch in flight."""
        tokens = self.scheduler.on_step_result(self.model.execute(self.in_flight.popleft()))
        if tokens is not None:
            self._receive(tokens)

    def run_once(self) -> bool:
        """One turn of the scheduler's loop; False once there is nothing to do."""
        if self.scheduler.can_plan_step() and not self._is_idle_and_empty():
            if self.plan() is not None:
                return True
        if not self.in_flight:
            return False
        self.complete()
        return True

    def run(self, max_turns: int = 100_000) -> None:
        for _ in range(max_turns):
            if not self.run_once():
                break
        else:
            raise AssertionError("the engine never went idle")
        self.check_idle()

    def check_idle(self) -> None:
        statistics = self.scheduler.statistics()
        assert statistics.num_running == 0
        assert statistics.num_free_blocks == statistics.num_total_blocks
        assert len(self.queue) == 0

    def _is_idle_and_empty(self) -> bool:
        return self.scheduler.is_idle and len(self.queue) == 0

    def _pull(self) -> list[WaitingRequest]:
        pull = self.scheduler.next_pull()
        if pull is None:
            return []
        self.queue.remember_pull(pull)
        pulled = self.queue.answer_pull()
        assert pulled is not None and len(pulled.requests) <= pull.max_requests
        return pulled.requests

    def _receive(self, tokens: TokenBatch) -> None:
        for delta in tokens.deltas:
            assert delta.request_id in self.tracked, "tokens before Track"
            assert delta.request_id not in self.finishes, "tokens after the finish"
            self.outputs[delta.request_id] += delta.token_ids
            if delta.finish_reason is not None:
                self._finish(delta.request_id, (delta.finish_reason, delta.stop_reason))

    def _finish(self, request_id: str, finish: tuple[str, int | None]) -> None:
        assert request_id not in self.finishes
        self.finishes[request_id] = finish


def config(**overrides: Any) -> EngineConfig:
    # decode snapshots (hybrid models) at every block: short outputs reach them
    fields: dict[str, Any] = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                                  decode_snapshot_interval=1)
    fields.update(overrides)
    return EngineConfig(**fields)


def assert_reference_outputs(driver: Driver, requests: list[Request]) -> None:
    for request in requests:
        tokens, finish_reason, stop_reason = reference_output(request)
        assert driver.outputs[request.request_id] == tokens, request.request_id
        assert driver.finishes[request.request_id] == (finish_reason, stop_reason)


def run_workload(requests: list[Request], num_kv_blocks: int, **overrides: Any) -> Driver:
    driver = Driver(config(**overrides), num_kv_blocks)
    driver.submit(*requests)
    driver.run()
    return driver


# -- exactness ----------------------------------------------------------------------


@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_mixed_workload_matches_the_reference(pipeline_depth, scheduling_policy):
    requests = random_workload(random.Random(1), 32, num_priorities=3)
    driver = run_workload(requests, num_kv_blocks=512, pipeline_depth=pipeline_depth,
                          scheduling_policy=scheduling_policy)
    assert_reference_outputs(driver, requests)
    assert {reason for reason, _ in driver.finishes.values()} == {"stop", "length"}
    assert driver.scheduler.statistics().num_preemptions == 0


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_tiny_kv_cache_preempts_and_changes_no_output(pipeline_depth):
    requests = random_workload(random.Random(2), 32)
    # Just enough for the longest request alone: 40 + 24 tokens in blocks of 4.
    driver = run_workload(requests, num_kv_blocks=16, pipeline_depth=pipeline_depth)
    assert driver.scheduler.statistics().num_preemptions > 0
    assert_reference_outputs(driver, requests)


def test_each_request_alone_gives_what_it_gives_in_the_batch():
    requests = random_workload(random.Random(3), 8)
    together = run_workload(requests, num_kv_blocks=64)
    for request in requests:
        alone = run_workload([request], num_kv_blocks=64)
        assert alone.outputs[request.request_id] == together.outputs[request.request_id]


def test_statistics_count_steps_and_tokens():
    requests = random_workload(random.Random(4), 6)
    driver = run_workload(requests, num_kv_blocks=64)
    statistics = driver.scheduler.statistics()
    assert statistics.num_steps == len(driver.model.batches)
    assert statistics.num_generation_tokens == sum(map(len, driver.outputs.values()))
    assert statistics.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in requests)


# -- batching ---------------------------------------------------------------------------


def test_long_prompts_are_prefilled_in_chunks_under_the_budget():
    request = make_request("long", list(range(50)), max_tokens=3)
    driver = run_workload([request], num_kv_blocks=64, max_num_batched_tokens=16,
                          pipeline_depth=1)
    chunks = [batch.requests[0] for batch in driver.model.batches]
    assert [len(chunk.token_ids) for chunk in chunks[:4]] == [16, 16, 16, 2]
    assert [chunk.num_computed_tokens for chunk in chunks[:4]] == [0, 16, 32, 48]
    assert [chunk.sample for chunk in chunks[:4]] == [False, False, False, True]
    assert_reference_outputs(driver, [request])


def test_a_prompt_takes_at_most_the_long_prefill_threshold_of_a_step():
    # vLLM's --long-prefill-token-threshold: the budget left after the first chunk
    # goes to the next prompt, not to more of the first
    long = make_request("long", list(range(50)), max_tokens=3)
    short = make_request("short", list(range(100, 104)), arrival_index=1, max_tokens=3)
    driver = run_workload([long, short], num_kv_blocks=64, max_num_batched_tokens=32,
                          long_prefill_token_threshold=12, pipeline_depth=1)
    batches = driver.model.batches
    assert [(r.request_id, len(r.token_ids)) for r in batches[0].requests] == [("long", 12),
                                                                               ("short", 4)]
    long_chunks = [len(r.token_ids) for batch in batches for r in batch.requests
                   if r.request_id == "long" and r.num_computed_tokens < 50]
    assert long_chunks == [12, 12, 12, 12, 2]
    assert_reference_outputs(driver, [long, short])


def test_no_batch_exceeds_the_token_budget_or_the_seats():
    requests = random_workload(random.Random(5), 20)
    driver = run_workload(requests, num_kv_blocks=256, max_num_batched_tokens=20, max_num_seqs=3)
    assert max(batch.num_tokens for batch in driver.model.batches) <= 20
    assert max(len(batch.requests) for batch in driver.model.batches) <= 3
    assert driver.max_num_running <= 3
    assert_reference_outputs(driver, requests)


def test_running_decodes_go_before_a_new_prefill():
    driver = Driver(config(max_num_batched_tokens=8, pipeline_depth=1), 64)
    driver.submit(make_request("first", [1, 2, 3], max_tokens=10))
    assert driver.plan() is not None
    driver.complete()
    driver.submit(make_request("second", list(range(20)), arrival_index=1, max_tokens=2))
    batch = driver.plan()
    assert batch is not None
    assert [(r.request_id, len(r.token_ids)) for r in batch.requests] == [("first", 1),
                                                                          ("second", 7)]


def test_new_requests_are_announced_once_and_finished_ones_are_listed_once():
    requests = random_workload(random.Random(6), 10)
    driver = run_workload(requests, num_kv_blocks=256)
    # The last finishes are listed in the batch after them: run one more.
    driver.submit(make_request("tail", [1], max_tokens=1, arrival_index=10))
    driver.run()
    new_ids = [new.request_id for batch in driver.model.batches for new in batch.new_requests]
    finished_ids = [rid for batch in driver.model.batches for rid in batch.finished_request_ids]
    assert sorted(new_ids) == sorted([request.request_id for request in requests] + ["tail"])
    assert sorted(finished_ids) == sorted(request.request_id for request in requests)


def test_pulls_ask_only_for_what_could_start():
    driver = Driver(config(max_num_seqs=8, max_num_batched_tokens=12), 4)
    assert driver.scheduler.next_pull() == Pull(max_requests=4, wait=True)
    driver.submit(*[make_request(f"r{index}", [1, 2, 3, 4], max_tokens=8, arrival_index=index)
                    for index in range(3)])
    driver.plan()
    # 3 running: 5 seats, 1 free block, 9 tokens of budget left after their decodes.
    assert driver.scheduler.next_pull() == Pull(max_requests=1, wait=False)


# -- finishing --------------------------------------------------------------------------


def test_a_stop_token_counts_only_from_min_tokens_on():
    every_token = list(range(VOCAB_SIZE))
    eager = make_request("eager", [5, 6], max_tokens=10, stop_token_ids=every_token)
    patient = make_request("patient", [5, 6], max_tokens=10, stop_token_ids=every_token,
                           min_tokens=3, arrival_index=1)
    driver = run_workload([eager, patient], num_kv_blocks=16)
    assert len(driver.outputs["eager"]) == 1 and driver.finishes["eager"][0] == "stop"
    assert len(driver.outputs["patient"]) == 4 and driver.finishes["patient"][0] == "stop"
    assert driver.finishes["patient"][1] == driver.outputs["patient"][-1]


def test_max_tokens_ends_with_length():
    request = make_request("r", [1, 2, 3], max_tokens=5)
    driver = run_workload([request], num_kv_blocks=16)
    assert len(driver.outputs["r"]) == 5 and driver.finishes["r"] == ("length", None)


# -- depth-2 pipelining -------------------------------------------------------------------


def test_depth_two_plans_the_next_step_with_a_placeholder():
    driver = Driver(config(pipeline_depth=2), 16)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=4))
    first = driver.plan()
    second = driver.plan()  # planned before the first result arrived
    assert first is not None and second is not None
    assert not driver.scheduler.can_plan_step()
    decode = second.requests[0]
    assert decode.input_from_previous_step and decode.token_ids == []
    assert decode.num_computed_tokens == 3 and decode.output_index == 1
    assert decode.new_block_ids == [] and first.requests[0].new_block_ids != []


def test_depth_two_never_plans_beyond_max_tokens():
    driver = Driver(config(pipeline_depth=2), 16)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=1))
    assert driver.plan() is not None
    assert driver.plan() is None
    driver.run()
    assert sum(r.sample for b in driver.model.batches for r in b.requests) == 1


def test_depth_two_drops_the_token_computed_after_a_stop():
    every_token = list(range(VOCAB_SIZE))
    request = make_request("r", [1, 2], max_tokens=8, stop_token_ids=every_token, min_tokens=2)
    driver = run_workload([request], num_kv_blocks=16, pipeline_depth=2)
    assert driver.outputs["r"] == reference_output(request)[0]
    num_sampled = sum(r.sample for b in driver.model.batches for r in b.requests)
    assert num_sampled == len(driver.outputs["r"]) + 1


def test_depth_one_has_one_batch_in_flight():
    driver = Driver(config(pipeline_depth=1), 16)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=4))
    assert driver.plan() is not None
    assert not driver.scheduler.can_plan_step()


@pytest.mark.parametrize("num_kv_blocks", [16, 512])
def test_depth_one_and_two_give_identical_tokens(num_kv_blocks):
    requests = random_workload(random.Random(7), 24)
    depth_one = run_workload(requests, num_kv_blocks, pipeline_depth=1)
    depth_two = run_workload(requests, num_kv_blocks, pipeline_depth=2)
    assert depth_one.outputs == depth_two.outputs
    assert depth_one.finishes == depth_two.finishes


# -- priority and preemption ------------------------------------------------------------


def test_priority_policy_starts_the_best_waiting_request_first():
    driver = Driver(config(scheduling_policy="priority", max_num_seqs=1), 64)
    requests = [make_request(f"r{index}", [1, 2], max_tokens=3, priority=priority,
                             arrival_index=index)
                for index, priority in enumerate([5, 5, 1, 3, 1])]
    driver.submit(*requests)
    driver.run()
    order = sorted(driver.first_step, key=driver.first_step.__getitem__)
    assert order == ["r2", "r4", "r3", "r0", "r1"]


def test_fcfs_ignores_priority():
    driver = Driver(config(scheduling_policy="fcfs", max_num_seqs=1), 64)
    driver.submit(*[make_request(f"r{index}", [1], max_tokens=2, priority=-index,
                                 arrival_index=index) for index in range(4)])
    driver.run()
    assert sorted(driver.first_step, key=driver.first_step.__getitem__) == ["r0", "r1", "r2", "r3"]


def test_preemption_takes_the_latest_arrival_under_fcfs():
    # Two requests that each grow past half of a 4-block cache.
    driver = Driver(config(pipeline_depth=1), 4)
    early = make_request("early", [1] * 4, max_tokens=8, arrival_index=0)
    late = make_request("late", [2] * 4, max_tokens=8, arrival_index=1)
    driver.submit(early, late)
    driver.run()
    assert driver.preempted[0] == "late"
    assert driver.scheduler.statistics().num_preemptions == len(driver.preempted)
    assert_reference_outputs(driver, [early, late])


def test_preemption_takes_the_lowest_priority_under_priority():
    driver = Driver(config(pipeline_depth=1, scheduling_policy="priority"), 4)
    important = make_request("important", [1] * 4, max_tokens=8, priority=0, arrival_index=1)
    other = make_request("other", [2] * 4, max_tokens=8, priority=1, arrival_index=0)
    driver.submit(important, other)
    driver.run()
    assert driver.preempted and set(driver.preempted) == {"other"}
    assert next(iter(driver.finishes)) == "important"
    assert_reference_outputs(driver, [important, other])


def _fill_seats(driver: Driver, priority: int, num_requests: int) -> list[Request]:
    requests = [make_request(f"low{index}", [1, 2, 3], max_tokens=30, priority=priority,
                             arrival_index=index) for index in range(num_requests)]
    driver.submit(*requests)
    for _ in range(4):
        driver.run_once()
    assert driver.scheduler.statistics().num_running == num_requests
    return requests


def test_priority_preemption_evicts_a_running_request_beyond_the_threshold():
    driver = Driver(config(scheduling_policy="priority", priority_preemption_threshold=5,
                           max_num_seqs=2, pipeline_depth=1), 64)
    low = _fill_seats(driver, priority=10, num_requests=2)
    urgent = make_request("urgent", [7, 8], max_tokens=3, priority=4, arrival_index=10)
    driver.submit(urgent)
    batch = driver.plan()
    assert batch is not None and batch.requests[0].request_id == "urgent"
    assert batch.finished_request_ids == ["low1"]  # the later of the two equals
    assert driver.scheduler.statistics().num_preemptions == 1
    driver.run()
    assert_reference_outputs(driver, [*low, urgent])


def test_priority_below_the_threshold_waits_for_a_seat():
    driver = Driver(config(scheduling_policy="priority", priority_preemption_threshold=7,
                           max_num_seqs=2, pipeline_depth=1), 64)
    _fill_seats(driver, priority=10, num_requests=2)
    driver.submit(make_request("urgent", [7, 8], max_tokens=3, priority=4, arrival_index=10))
    batch = driver.plan()
    assert batch is not None and "urgent" not in [r.request_id for r in batch.requests]
    assert driver.scheduler.statistics().num_preemptions == 0
    assert "urgent" in driver.queue


def test_priority_preemption_needs_the_setting():
    driver = Driver(config(scheduling_policy="priority", max_num_seqs=2,
                           pipeline_depth=1), 64)
    _fill_seats(driver, priority=10, num_requests=2)
    driver.submit(make_request("urgent", [7, 8], max_tokens=3, priority=-100, arrival_index=10))
    assert driver.scheduler.next_pull() is None
    driver.run()
    assert driver.scheduler.statistics().num_preemptions == 0


def test_priority_preemption_when_blocks_are_short():
    # Seats are free but the cache is full of a low-priority request.
    driver = Driver(config(scheduling_policy="priority", priority_preemption_threshold=1,
                           pipeline_depth=1), 8)
    low = make_request("low", list(range(28)), max_tokens=4, priority=5)
    driver.submit(low)
    driver.plan()
    driver.complete()
    urgent = make_request("urgent", list(range(30, 38)), max_tokens=2, priority=0,
                          arrival_index=1)
    driver.submit(urgent)
    batch = driver.plan()
    assert batch is not None and batch.requests[0].request_id == "urgent"
    assert batch.finished_request_ids == ["low"]
    driver.run()
    assert_reference_outputs(driver, [low, urgent])


# -- prefix caching ----------------------------------------------------------------------


def first_chunks(driver: Driver) -> dict[str, Any]:
    """Each request's first ScheduledRequest (of its last life, if it was preempted)."""
    chunks: dict[str, Any] = {}
    for batch in driver.model.batches:
        for new_request in batch.new_requests:
            chunks.pop(new_request.request_id, None)
        for scheduled in batch.requests:
            chunks.setdefault(scheduled.request_id, scheduled)
    return chunks


@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("num_kv_blocks", [20, 512])
@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_prefix_caching_changes_no_output(pipeline_depth, num_kv_blocks, scheduling_policy):
    rng = random.Random(11)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in (9, 17, 30)]
    requests = random_workload(rng, 32, max_prompt_len=12, num_priorities=3,
                               shared_prefixes=prefixes)
    threshold = 1 if scheduling_policy == "priority" else None
    runs = {enabled: run_workload(requests, num_kv_blocks, pipeline_depth=pipeline_depth,
                                  scheduling_policy=scheduling_policy,
                                  priority_preemption_threshold=threshold,
                                  enable_prefix_caching=enabled)
            for enabled in (False, True)}
    assert_reference_outputs(runs[True], requests)
    assert runs[True].outputs == runs[False].outputs
    assert runs[True].finishes == runs[False].finishes
    cached, uncached = runs[True].scheduler.statistics(), runs[False].scheduler.statistics()
    assert runs[True].model.num_cached_tokens_read > 0
    assert 0 < cached.num_prefix_cache_hits < cached.num_prefix_cache_queries
    assert cached.num_prompt_tokens < uncached.num_prompt_tokens
    if num_kv_blocks == 20:
        assert cached.num_preemptions > 0


def test_a_second_request_starts_after_the_first_ones_cached_blocks():
    first = make_request("first", list(range(10)), max_tokens=3)
    driver = run_workload([first], 64, pipeline_depth=1)
    first_block_ids = first_chunks(driver)["first"].new_block_ids
    second = make_request("second", list(range(10)) + [50, 51], max_tokens=3, arrival_index=1)
    driver.submit(second)
    driver.run()
    chunk = first_chunks(driver)["second"]
    # Blocks of 4: two full prompt blocks match; the third holds 8, 9 and first's output.
    assert chunk.num_computed_tokens == 8 and chunk.token_ids == [8, 9, 50, 51]
    assert chunk.new_block_ids[:2] == first_block_ids[:2]
    assert chunk.new_block_ids[2] not in first_block_ids
    statistics = driver.scheduler.statistics()
    assert (statistics.num_prefix_cache_queries, statistics.num_prefix_cache_hits) == (22, 8)
    assert_reference_outputs(driver, [first, second])


def test_an_identical_prompt_still_computes_its_last_block():
    prompt = list(range(8))
    driver = run_workload([make_request("a", prompt)], 64, pipeline_depth=1)
    driver.submit(make_request("b", prompt, arrival_index=1))
    driver.run()
    chunk = first_chunks(driver)["b"]
    assert chunk.num_computed_tokens == 4 and chunk.token_ids == [4, 5, 6, 7] and chunk.sample
    assert driver.outputs["a"] == driver.outputs["b"]


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_blocks_filled_by_decoding_are_cached_for_the_next_turn(pipeline_depth):
    first = make_request("turn1", list(range(6)), max_tokens=10)
    driver = run_workload([first], 64, pipeline_depth=pipeline_depth)
    history = first.prompt_token_ids + driver.outputs["turn1"]
    second = make_request("turn2", history + [60, 61], max_tokens=2, arrival_index=1)
    driver.submit(second)
    driver.run()
    # turn1 computed positions 0 to 14 (its last output token never runs): 3 full blocks.
    assert first_chunks(driver)["turn2"].num_computed_tokens == 12
    assert_reference_outputs(driver, [first, second])


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_decoded_blocks_are_cached_when_the_request_stops(pipeline_depth):
    driver = Driver(config(pipeline_depth=pipeline_depth), 64)
    block_manager = driver.scheduler.block_manager
    driver.submit(make_request("r", [1, 2, 3, 4, 5], max_tokens=20))
    while driver.run_once() and "r" not in driver.finishes:
        assert block_manager.num_cached_blocks == 1  # its prompt's one full block
    driver.run()
    assert block_manager.num_cached_blocks == 24 // 4  # 5 + 19 computed positions


def test_a_block_whose_last_token_is_still_in_flight_is_not_cached():
    driver = Driver(config(pipeline_depth=2), 64)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=8))
    driver.plan()
    driver.plan()  # decodes position 3 with the token step 0 is still sampling
    driver.abort("r")
    assert driver.scheduler.block_manager.num_cached_blocks == 0
    driver.run()


def test_a_request_shares_blocks_scheduled_earlier_in_the_same_step():
    shared = list(range(12))
    a = make_request("a", shared + [40], max_tokens=4)
    b = make_request("b", shared + [41], max_tokens=4, arrival_index=1)
    driver = Driver(config(pipeline_depth=2), 64)
    driver.submit(a, b)
    batch = driver.plan()
    assert batch is not None
    chunk_a, chunk_b = batch.requests
    assert chunk_b.num_computed_tokens == 12 and chunk_b.token_ids == [41]
    assert chunk_b.new_block_ids[:3] == chunk_a.new_block_ids[:3]
    driver.run()
    assert_reference_outputs(driver, [a, b])


def test_only_requests_with_the_same_cache_salt_share_blocks():
    prompt = list(range(12))
    requests = [make_request("plain", prompt),
                make_request("salted", prompt, arrival_index=1, cache_salt="tenant-a"),
                make_request("same-salt", prompt, arrival_index=2, cache_salt="tenant-a"),
                make_request("other-salt", prompt, arrival_index=3, cache_salt="tenant-b"),
                make_request("plain-again", prompt, arrival_index=4)]
    driver = run_workload(requests, 64, max_num_seqs=1)  # one after another
    cached = {request_id: chunk.num_computed_tokens
              for request_id, chunk in first_chunks(driver).items()}
    assert cached == {"plain": 0, "salted": 0, "same-salt": 8, "other-salt": 0,
                      "plain-again": 8}
    assert_reference_outputs(driver, requests)


def test_with_prefix_caching_off_nothing_is_shared_or_counted():
    requests = [make_request(f"r{index}", list(range(12)), arrival_index=index)
                for index in range(3)]
    driver = run_workload(requests, 64, enable_prefix_caching=False, max_num_seqs=1)
    assert driver.model.num_cached_tokens_read == 0
    statistics = driver.scheduler.statistics()
    assert statistics.num_prefix_cache_queries == statistics.num_prefix_cache_hits == 0
    assert driver.scheduler.block_manager.num_cached_blocks == 0
    assert_reference_outputs(driver, requests)


def test_cached_blocks_are_evicted_oldest_first_when_memory_runs_short():
    driver = Driver(config(pipeline_depth=1, max_num_seqs=1), 8)  # 8 blocks of 4
    block_manager = driver.scheduler.block_manager
    old = make_request("old", list(range(16)), max_tokens=1)
    driver.submit(old)
    driver.run()
    assert block_manager.num_cached_blocks == 4
    # 6 blocks: the 4 anonymous ones, then old's last two (its least useful).
    filler = make_request("filler", list(range(100, 124)), max_tokens=1, arrival_index=1)
    driver.submit(filler)
    driver.run()
    assert block_manager.num_evictions == 2
    again = make_request("again", list(range(16)) + [7], max_tokens=1, arrival_index=2)
    driver.submit(again)
    driver.run()
    assert first_chunks(driver)["again"].num_computed_tokens == 8  # old's first two blocks
    assert block_manager.num_evictions == 5  # its 3 new blocks evicted filler's
    assert_reference_outputs(driver, [old, filler, again])


def test_priority_preemption_counts_shared_blocks_once_their_last_holder_goes():
    # Two low-priority requests share a 2-block prefix; each holds 2 blocks of its own.
    driver = Driver(config(scheduling_policy="priority", priority_preemption_threshold=1,
                           pipeline_depth=1), 8)
    shared = [60, 61, 62, 63, 60, 61, 62, 63]
    low = [make_request(f"low{index}", shared + [index] * 4, max_tokens=6, priority=5,
                        arrival_index=index) for index in range(2)]
    driver.submit(*low)
    for _ in range(2):  # the prefill, then the decodes that open a block each
        driver.plan()
        driver.complete()
    assert driver.scheduler.block_manager.num_free_blocks == 2
    # 5 blocks: low1 alone frees only its 2 own blocks; with low0 the shared ones go too.
    urgent = make_request("urgent", list(range(20)), max_tokens=1, priority=0, arrival_index=2)
    driver.submit(urgent)
    batch = driver.plan()
    assert batch is not None and batch.requests[0].request_id == "urgent"
    assert sorted(batch.finished_request_ids) == ["low0", "low1"]
    driver.run()
    assert_reference_outputs(driver, [*low, urgent])


def test_priority_admission_leaves_room_for_better_running_requests():
    # 6 blocks of 4: "best" (priority 0) holds 1 and opens a second with its next
    # decode; "worst" (3) holds 2; "middle" (1) needs 5. Evicting "worst" frees 5:
    # enough for "middle", but then "best" would have to preempt itself.
    driver = Driver(config(scheduling_policy="priority", priority_preemption_threshold=1,
                           pipeline_depth=1), 6)
    best = make_request("best", [1, 2, 3, 4], max_tokens=6, priority=0)
    worst = make_request("worst", list(range(10, 18)), max_tokens=6, priority=3, arrival_index=1)
    driver.submit(best, worst)
    driver.plan()
    driver.complete()
    middle = make_request("middle", list(range(20, 40)), max_tokens=2, priority=1,
                          arrival_index=2)
    driver.submit(middle)
    batch = driver.plan()
    assert batch is not None
    assert [r.request_id for r in batch.requests] == ["best", "worst"]
    assert driver.preempted == []
    driver.run()
    assert_reference_outputs(driver, [best, worst, middle])


# -- aborts and stop strings ------------------------------------------------------------


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_abort_of_a_running_request_frees_it_and_ends_its_output(pipeline_depth):
    driver = Driver(config(pipeline_depth=pipeline_depth), 16)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=20),
                  make_request("other", [4, 5], max_tokens=12, arrival_index=1))
    for _ in range(5):
        driver.run_once()
    driver.abort("r")
    assert driver.finishes["r"] == ("abort", None)
    assert driver.scheduler.statistics().num_running == 1
    num_planned = len(driver.model.batches) + len(driver.in_flight)
    driver.run()
    planned_after = driver.model.batches[num_planned:]
    assert planned_after[0].finished_request_ids == ["r"]
    assert all(r.request_id == "other" for b in planned_after for r in b.requests)
    assert 0 < len(driver.outputs["r"]) < 20


def test_abort_of_a_waiting_request_never_runs_it():
    driver = Driver(config(max_num_seqs=1), 16)
    driver.submit(make_request("a", [1], max_tokens=3), make_request("b", [1], arrival_index=1))
    driver.run_once()
    driver.abort("b")
    driver.run()
    assert "b" not in driver.first_step and driver.finishes["b"] == ("abort", None)


def test_abort_of_a_preempted_request_is_finished_by_the_scheduler():
    driver = Driver(config(pipeline_depth=1), 4)
    driver.submit(make_request("early", [1] * 4, max_tokens=8),
                  make_request("late", [2] * 4, max_tokens=8, arrival_index=1))
    while not driver.preempted:
        driver.run_once()
    assert "late" in driver.queue
    driver.abort("late")  # the detokenizer tracks it: the abort goes through the scheduler
    assert driver.finishes["late"] == ("abort", None)
    assert "late" not in driver.queue
    driver.run()
    assert driver.finishes["early"][0] == "length"


def test_abort_of_an_unknown_request_is_harmless():
    driver = Driver(config(), 16)
    assert driver.scheduler.abort("nobody") is None
    driver.scheduler.on_stop_string_hit("nobody")


def test_a_stop_string_hit_frees_the_request_silently():
    driver = Driver(config(pipeline_depth=1), 16)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=20))
    while len(driver.outputs["r"]) < 3:
        driver.run_once()
    driver.scheduler.on_stop_string_hit("r")
    assert driver.scheduler.statistics().num_running == 0
    assert driver.scheduler.statistics().num_free_blocks == 16
    driver.run()
    assert len(driver.outputs["r"]) == 3 and "r" not in driver.finishes


# -- randomized invariants ----------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Once a livelock: a priority admission left no block for a better request's decode,
# which preempted itself, and at depth 2 the two took turns evicting each other.
@example(seed=39704, block_size=1, num_spare_blocks=0, max_num_batched_tokens=29,
         max_num_seqs=5, pipeline_depth=2, scheduling_policy="priority", threshold=1,
         num_aborts=0, enable_prefix_caching=True, num_shared_prefixes=3)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_spare_blocks=st.integers(0, 12),
    max_num_batched_tokens=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    pipeline_depth=st.sampled_from([1, 2]),
    scheduling_policy=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([None, 0, 1, 3]),
    num_aborts=st.integers(0, 4),
    enable_prefix_caching=st.booleans(),
    num_shared_prefixes=st.integers(0, 3),
)
def test_random_schedules_conserve_blocks_and_lose_no_request(
        seed, block_size, num_spare_blocks, max_num_batched_tokens, max_num_seqs,
        pipeline_depth, scheduling_policy, threshold, num_aborts, enable_prefix_caching,
        num_shared_prefixes):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
                for _ in range(num_shared_prefixes)]
    requests = random_workload(rng, 12, max_prompt_len=20 - 12 * bool(prefixes),
                               max_output_len=12, num_priorities=4, shared_prefixes=prefixes)
    num_kv_blocks = -(-32 // block_size) + num_spare_blocks  # the longest request fits alone
    driver = Driver(config(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                           max_num_seqs=max_num_seqs, pipeline_depth=pipeline_depth,
                           scheduling_policy=scheduling_policy,
                           priority_preemption_threshold=threshold,
                           enable_prefix_caching=enable_prefix_caching), num_kv_blocks)
    arrivals = deque(requests)
    aborted = set(rng.sample([request.request_id for request in requests], num_aborts))
    abort_turns = {request_id: rng.randrange(60) for request_id in aborted}
    for turn in range(5_000):
        if arrivals and rng.random() < 0.5:
            driver.submit(arrivals.popleft())
        for request_id in [rid for rid, when in abort_turns.items() if when == turn]:
            arrived = request_id not in {request.request_id for request in arrivals}
            if arrived and request_id not in driver.finishes:
                driver.abort(request_id)
        statistics = driver.scheduler.statistics()
        held = {block_id for s in driver.scheduler._running for block_id in s.block_ids}
        assert len(held) + statistics.num_free_blocks == num_kv_blocks
        if not driver.run_once() and not arrivals and turn > 60:
            break
    driver.check_idle()
    assert set(driver.finishes) == {request.request_id for request in requests}
    for request in requests:
        tokens, finish_reason, stop_reason = reference_output(request)
        if driver.finishes[request.request_id][0] == "abort":
            assert request.request_id in aborted
            assert tokens[:len(driver.outputs[request.request_id])] == driver.outputs[
                request.request_id]
        else:
            assert driver.outputs[request.request_id] == tokens
            assert driver.finishes[request.request_id] == (finish_reason, stop_reason)


# -- the actor ------------------------------------------------------------------------------


class Gate:
    """Lets the fake runner's steps through only while open."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()


async def run_fake_runner(inbox: trio.MemoryReceiveChannel[Any],
                          scheduler_outbox: trio.MemorySendChannel[Any], model: FakeModel,
                          gate: Gate, rng: random.Random, *,
                          task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async with scheduler_outbox:
        async for batch in inbox:
            await gate.wait_open()
            for _ in range(rng.randrange(4)):  # let other actors interleave differently
                await trio.lowlevel.checkpoint()
            await scheduler_outbox.send(model.execute(batch))


async def run_fake_detokenizer(inbox: trio.MemoryReceiveChannel[Any],
                               scheduler_outbox: trio.MemorySendChannel[Any],
                               streams: RequestStreams, stop_after: dict[str, int],
                               unfinished: set[str], *,
                               task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Publishes token deltas as outputs; plays a stop string after
    ``stop_after[request_id]`` tokens. Checks Track comes first; keeps
    ``unfinished``: the requests it tracks and saw no finish of."""
    tracked: dict[str, int] = {}
    finished: set[str] = set()
    task_status.started()
    async with scheduler_outbox:
        async for message in inbox:
            if isinstance(message, Track):
                assert message.request.request_id not in tracked
                tracked[message.request.request_id] = 0
                unfinished.add(message.request.request_id)
                continue
            for delta in message.deltas:
                request_id = delta.request_id
                assert request_id in tracked, "tokens before Track"
                if request_id in finished:
                    continue
                tracked[request_id] += len(delta.token_ids)
                finish_reason = delta.finish_reason
                if tracked[request_id] == stop_after.get(request_id) and finish_reason is None:
                    finish_reason = "stop"
                    await scheduler_outbox.send(StopStringHit(request_id=request_id))
                if finish_reason is not None:
                    finished.add(request_id)
                    unfinished.discard(request_id)
                streams.publish(RequestOutput(request_id=request_id, token_ids=delta.token_ids,
                                              text="", finished=finish_reason is not None,
                                              finish_reason=finish_reason))


class ActorHarness:
    """The queue and scheduler actors with a fake runner and detokenizer."""

    def __init__(self, config: EngineConfig, num_kv_blocks: int, *, seed: int = 0,
                 stop_after: dict[str, int] | None = None) -> None:
        self.config = config
        self.streams = RequestStreams()
        self.queue = WaitingQueue(config)
        self.scheduler = Scheduler(config, num_kv_blocks)
        self.model = FakeModel(config.block_size)
        self.gate = Gate()
        self.rng = random.Random(seed)
        self.stop_after = stop_after or {}
        self.unfinished: set[str] = set()
        self.queue_inbox: trio.MemorySendChannel[Any]

    async def start(self, nursery: trio.Nursery) -> None:
        queue_send, queue_receive = trio.open_memory_channel[Any](64)
        scheduler_send, scheduler_receive = trio.open_memory_channel[Any](1024)
        runner_send, runner_receive = trio.open_memory_channel[Any](2)
        detokenizer_send, detokenizer_receive = trio.open_memory_channel[Any](8)
        await nursery.start(run_fake_runner, runner_receive, scheduler_send.clone(), self.model,
                            self.gate, self.rng)
        await nursery.start(run_fake_detokenizer, detokenizer_receive, scheduler_send.clone(),
                            self.streams, self.stop_after, self.unfinished)
        await nursery.start(run_scheduler, scheduler_receive, queue_send.clone(), runner_send,
                            detokenizer_send, self.scheduler)
        await nursery.start(run_queue, queue_receive, scheduler_send, self.streams, self.config,
                            self.queue)
        self.queue_inbox = queue_send

    async def generate(self, request: Request, results: dict[str, Any], *,
                       abort_after: int | None = None) -> None:
        """Submit a request and read its stream to the end, like a caller."""
        stream = self.streams.open(request.request_id)
        await self.queue_inbox.send(Admit(request=request))
        token_ids: list[int] = []
        num_outputs = 0
        while True:
            output = await stream.receive()
            token_ids += output.token_ids
            num_outputs += 1
            if output.finished:
                break
            if num_outputs == abort_after:
                await self.queue_inbox.send(Abort(request_id=request.request_id))
        self.streams.close(request.request_id)
        results[request.request_id] = (token_ids, output.finish_reason)

    def check_idle(self) -> None:
        statistics = self.scheduler.statistics()
        assert statistics.num_running == 0
        assert statistics.num_free_blocks == statistics.num_total_blocks
        assert len(self.queue) == 0 and not self.queue._aborts_in_flight
        assert not self.unfinished, "the detokenizer would keep state for these"
        assert not self.scheduler._preempted_request_ids


async def run_all(engine: ActorHarness, requests: list[Request],
                  abort_after: dict[str, int] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    abort_after = abort_after or {}
    async with trio.open_nursery() as nursery:
        for request in requests:
            nursery.start_soon(lambda r=request: engine.generate(
                r, results, abort_after=abort_after.get(r.request_id)))
            await trio.lowlevel.checkpoint()
    await trio.testing.wait_all_tasks_blocked()
    return results


@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("num_kv_blocks", [16, 512])
async def test_actors_produce_the_reference_outputs(nursery, pipeline_depth, num_kv_blocks):
    with trio.fail_after(20):
        requests = random_workload(random.Random(8), 32)
        engine = ActorHarness(config(pipeline_depth=pipeline_depth), num_kv_blocks)
        await engine.start(nursery)
        results = await run_all(engine, requests)
        for request in requests:
            tokens, finish_reason, _ = reference_output(request)
            assert results[request.request_id] == (tokens, finish_reason)
        engine.check_idle()
        if num_kv_blocks == 16:
            assert engine.scheduler.statistics().num_preemptions > 0


@pytest.mark.parametrize("shared_prefixes", [False, True])
async def test_actors_cancel_half_of_many_requests_and_free_every_block(nursery,
                                                                         shared_prefixes):
    with trio.fail_after(30):
        rng = random.Random(9)
        prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in (6, 13)]
        requests = random_workload(rng, 100, num_priorities=3,
                                   max_prompt_len=40 - 13 * shared_prefixes,
                                   shared_prefixes=prefixes if shared_prefixes else None)
        aborting = {r.request_id: rng.randint(1, 4) for r in rng.sample(requests, 50)}
        engine = ActorHarness(config(scheduling_policy="priority", priority_preemption_threshold=1),
                        num_kv_blocks=24, seed=9)
        await engine.start(nursery)
        results = await run_all(engine, requests, aborting)
        for request in requests:
            tokens, finish_reason, _ = reference_output(request)
            got_tokens, got_reason = results[request.request_id]
            if got_reason == "abort":
                assert request.request_id in aborting
                assert got_tokens == tokens[:len(got_tokens)]
            else:
                assert (got_tokens, got_reason) == (tokens, finish_reason)
        assert sum(reason == "abort" for _, reason in results.values()) > 25
        engine.check_idle()
        if shared_prefixes:
            assert engine.model.num_cached_tokens_read > 0


async def test_actors_abort_a_request_while_its_step_runs(nursery):
    with trio.fail_after(5):
        engine = ActorHarness(config(pipeline_depth=2), 16)
        await engine.start(nursery)
        results: dict[str, Any] = {}
        engine.gate.close()
        nursery.start_soon(engine.generate, make_request("r", [1, 2, 3], max_tokens=10), results)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.scheduler.num_in_flight == 2
        await engine.queue_inbox.send(Abort(request_id="r"))
        await trio.testing.wait_all_tasks_blocked()
        assert results["r"] == ([], "abort")
        engine.gate.open()
        await trio.testing.wait_all_tasks_blocked()
        engine.check_idle()
        assert engine.scheduler.num_in_flight == 0
        assert len(engine.model.batches) == 2


async def test_actors_free_a_request_a_stop_string_finished(nursery):
    with trio.fail_after(5):
        request = make_request("r", [1, 2, 3], max_tokens=20)
        engine = ActorHarness(config(), 16, stop_after={"r": 3})
        await engine.start(nursery)
        results = await run_all(engine, [request])
        assert results["r"] == (reference_output(request)[0][:3], "stop")
        engine.check_idle()


async def test_idle_scheduler_asks_once_and_waits():
    with trio.fail_after(5):
        scheduler_send, scheduler_receive = trio.open_memory_channel[Any](8)
        queue_send, queue_receive = trio.open_memory_channel[Any](8)
        runner_send, runner_receive = trio.open_memory_channel[Any](2)
        detokenizer_send, detokenizer_receive = trio.open_memory_channel[Any](8)
        scheduler = Scheduler(config(), 16)
        async with trio.open_nursery() as nursery:
            await nursery.start(run_scheduler, scheduler_receive, queue_send, runner_send,
                                detokenizer_send, scheduler)
            await trio.testing.wait_all_tasks_blocked()
            assert queue_receive.receive_nowait() == Pull(max_requests=8, wait=True)
            with pytest.raises(trio.WouldBlock):
                queue_receive.receive_nowait()
            # An Abort for a request the scheduler never saw is answered at once.
            await scheduler_send.send(Abort(request_id="gone"))
            await trio.testing.wait_all_tasks_blocked()
            assert queue_receive.receive_nowait() == AbortOutcome(request_id="gone")
            request = make_request("r", [1, 2], max_tokens=2)
            await scheduler_send.send(Pulled(requests=[WaitingRequest(request=request)],
                                             num_waiting=0))
            await trio.testing.wait_all_tasks_blocked()
            assert detokenizer_receive.receive_nowait() == Track(request=request)
            batch = runner_receive.receive_nowait()
            assert batch.new_requests[0].request_id == "r"
            nursery.cancel_scope.cancel()
        with pytest.raises(trio.EndOfChannel):
            await runner_receive.receive()


async def test_a_scheduler_left_idle_by_a_result_it_got_while_pulling_asks_to_wait():
    """The last running request finishes in a StepResult that arrives while the
    scheduler waits for the answer to a Pull that does not wait (steps were in
    flight when it asked): the empty answer leaves it idle, with nothing in flight.
    It must ask again, waiting; had it waited on its inbox instead, nothing would
    ever arrive there, and every later request would wait in the queue for good
    (how a served engine core on the GPU, where a step's result comes back before
    the queue answers, stalled after its first workload)."""
    with trio.fail_after(5):
        scheduler_send, scheduler_receive = trio.open_memory_channel[Any](8)
        queue_send, queue_receive = trio.open_memory_channel[Any](8)
        runner_send, runner_receive = trio.open_memory_channel[Any](2)
        detokenizer_send, detokenizer_receive = trio.open_memory_channel[Any](8)
        scheduler = Scheduler(config(pipeline_depth=2), 16)
        async with trio.open_nursery() as nursery:
            await nursery.start(run_scheduler, scheduler_receive, queue_send, runner_send,
                                detokenizer_send, scheduler)
            await trio.testing.wait_all_tasks_blocked()
            assert queue_receive.receive_nowait().wait
            request = make_request("r", [1, 2], max_tokens=2)
            await scheduler_send.send(Pulled(requests=[WaitingRequest(request=request)],
                                             num_waiting=0))
            await trio.testing.wait_all_tasks_blocked()
            assert runner_receive.receive_nowait().step_id == 0  # the prefill
            assert not queue_receive.receive_nowait().wait
            await scheduler_send.send(Pulled(requests=[], num_waiting=0))
            await trio.testing.wait_all_tasks_blocked()
            assert runner_receive.receive_nowait().step_id == 1  # its last token, ahead
            await scheduler_send.send(StepResult(step_id=0, request_ids=["r"],
                                                 sampled_token_ids=[5]))
            await trio.testing.wait_all_tasks_blocked()
            assert not queue_receive.receive_nowait().wait  # step 1 is in flight
            # Step 1's result comes before the queue's answer, and ends the request.
            await scheduler_send.send(StepResult(step_id=1, request_ids=["r"],
                                                 sampled_token_ids=[6]))
            await scheduler_send.send(Pulled(requests=[], num_waiting=0))
            await trio.testing.wait_all_tasks_blocked()
            assert scheduler.is_idle
            assert queue_receive.receive_nowait() == Pull(max_requests=8, wait=True)
            finished = [message for message in _drain(detokenizer_receive)
                        if isinstance(message, TokenBatch)]
            assert finished[-1].deltas[-1].finish_reason == "length"
            nursery.cancel_scope.cancel()


def _drain(channel: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    messages = []
    while True:
        try:
            messages.append(channel.receive_nowait())
        except trio.WouldBlock:
            return messages


def test_a_stop_string_hit_while_preempted_drops_the_request_when_pulled():
    # "late" is preempted (see the test above), then a stop string ends it while it
    # waits: it must never run again, and the cache ends empty.
    driver = Driver(config(pipeline_depth=1), 4)
    early = make_request("early", [1] * 4, max_tokens=8, arrival_index=0)
    late = make_request("late", [2] * 4, max_tokens=8, arrival_index=1)
    driver.submit(early, late)
    while "late" not in driver.preempted:
        assert driver.run_once(), "late was never preempted"
    num_late_tokens = len(driver.outputs["late"])
    driver.scheduler.on_stop_string_hit("late")
    driver.run()  # ends with the cache empty and the queue empty
    assert len(driver.outputs["late"]) == num_late_tokens
    assert "late" not in driver.finishes  # the detokenizer finished it, not the scheduler
    assert driver.outputs["early"] and driver.finishes["early"][0] == "length"
