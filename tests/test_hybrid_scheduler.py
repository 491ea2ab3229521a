"""The scheduler with a model that has linear-attention layers (the hybrid family):
state slots as a resource, and prefix caching with state snapshots. Policy tests
driven without trio, with test_scheduler's Driver.

The fake model keeps, beside test_scheduler's fake KV cache, a state per slot: the
context hash and the number of tokens it has seen, which is exactly what a
recurrent state summarizes. A step continues a request from its slot (a slot
clobbered by anyone else fails an assertion), runs the batch's ``state_copies``
first, in order, and checks a restored state against the cached blocks it
continues (a snapshot that does not match its prefix fails). The copies run when
the batch executes, after every batch before it, as on the device at depth 2: a
save copied too early (in the batch of the chunk it should follow) saves the state
from before the chunk, and the first restore of it fails.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import (
    VOCAB_SIZE,
    Driver,
    FakeModel,
    assert_reference_outputs,
    config,
    make_request,
    random_workload,
    reference_output,
)

from trio_llm.actors.config import MAX_CHUNKED_SEQS, EngineConfig
from trio_llm.actors.messages import ScheduledBatch, StepResult, WaitingRequest
from trio_llm.actors.scheduler import Scheduler, _num_tokens_shared

State = tuple[int, int]  # (context hash, tokens seen)


class HybridFakeModel(FakeModel):
    """FakeModel plus a state cache of ``num_state_slots`` slots (see the module)."""

    def __init__(self, block_size: int, num_state_slots: int) -> None:
        super().__init__(block_size)
        self.num_state_slots = num_state_slots
        self.slot_states: dict[int, State] = {}
        self.request_slots: dict[str, int] = {}
        self.num_restored_tokens = 0
        self.num_saves = 0

    def execute(self, batch: ScheduledBatch) -> StepResult:
        assert num_chunks_of_two_or_more(batch) <= MAX_CHUNKED_SEQS
        finished = set(batch.finished_request_ids)
        new_slots = {new.request_id: new.state_slot for new in batch.new_requests}
        self._check_slots(finished, new_slots)
        self._copy_states(batch, finished, new_slots)
        for request_id in finished:
            del self.request_slots[request_id]
        self.request_slots.update({request_id: slot for request_id, slot in new_slots.items()
                                   if slot is not None})
        for scheduled in batch.requests:  # each continues from its own slot
            sequence = self.sequences.get(scheduled.request_id)
            if (sequence is not None and sequence.num_tokens
                    and scheduled.request_id not in new_slots):  # (else an earlier life's)
                slot = self.request_slots[scheduled.request_id]
                assert self.slot_states[slot] == (sequence.context_hash, sequence.num_tokens), \
                    f"slot {slot} of {scheduled.request_id} was overwritten"
        result = super().execute(batch)
        for scheduled in batch.requests:
            sequence = self.sequences[scheduled.request_id]
            self.slot_states[self.request_slots[scheduled.request_id]] = (
                sequence.context_hash, sequence.num_tokens)
        return result

    def _check_slots(self, finished: set[str], new_slots: dict[str, int | None]) -> None:
        surviving = {request_id: slot for request_id, slot in self.request_slots.items()
                     if request_id not in finished}
        for slot in new_slots.values():
            assert slot is not None and 0 <= slot < self.num_state_slots
        held = list(surviving.values()) + list(new_slots.values())  # type: ignore[arg-type]
        assert len(set(held)) == len(held), "a state slot is held twice"

    def _copy_states(self, batch: ScheduledBatch, finished: set[str],
                     new_slots: dict[str, int | None]) -> None:
        """Copies in order, before the forward. A save reads the slot of a request
        that ran before this batch (one that leaves in it too: its slot is only reset
        by its next owner's forward) and writes a slot nobody runs in; a restore
        writes a new request's slot."""
        held_slots = set(self.request_slots.values())
        surviving_slots = {slot for request_id, slot in self.request_slots.items()
                           if request_id not in finished}
        for source, destination in batch.state_copies:
            assert source in self.slot_states, f"slot {source} copied before it was written"
            assert destination not in surviving_slots, f"a copy overwrites running {destination}"
            if destination not in new_slots.values():  # a save
                assert source in held_slots, f"a save from slot {source}, which nobody ran in"
                self.num_saves += 1
            self.slot_states[destination] = self.slot_states[source]

    def _start_from_cache(self, sequence: Any, num_cached_tokens: int) -> None:
        super()._start_from_cache(sequence, num_cached_tokens)  # the KV chain checks out
        request_id = next(rid for rid, seq in self.sequences.items() if seq is sequence)
        slot_state = self.slot_states.get(self.request_slots[request_id])
        assert slot_state == (sequence.context_hash, num_cached_tokens), \
            "a restored state does not match its prefix"
        self.num_restored_tokens += num_cached_tokens


class HybridDriver(Driver):
    def __init__(self, config: EngineConfig, num_kv_blocks: int, num_state_slots: int) -> None:
        super().__init__(config, num_kv_blocks)
        self.scheduler = Scheduler(config, num_kv_blocks, num_state_slots=num_state_slots)
        self.model = HybridFakeModel(config.block_size, num_state_slots)

    def check_idle(self) -> None:
        super().check_idle()
        statistics = self.scheduler.statistics()
        assert statistics.num_pending_state_snapshots == 0, "a pending snapshot leaked"
        assert (statistics.num_free_state_slots + statistics.num_state_snapshots
                == statistics.num_total_state_slots), "a state slot leaked"


def run_hybrid(requests: list[Any], num_kv_blocks: int = 512, num_snapshots: int = 16,
               **overrides: Any) -> HybridDriver:
    engine_config = config(**overrides)
    driver = HybridDriver(engine_config, num_kv_blocks, engine_config.max_num_seqs + num_snapshots)
    driver.submit(*requests)
    driver.run()
    return driver


def num_chunks_of_two_or_more(batch: ScheduledBatch) -> int:
    return sum(len(scheduled.token_ids) > 1 for scheduled in batch.requests)


def chunks_of(driver: Driver, request_id: str) -> list[Any]:
    """Its scheduled chunks (every life), with the id of the step of each."""
    return [(batch.step_id, scheduled) for batch in driver.model.batches
            for scheduled in batch.requests if scheduled.request_id == request_id]


def slot_of(driver: Driver, request_id: str) -> int:
    return next(new.state_slot for batch in driver.model.batches for new in batch.new_requests
                if new.request_id == request_id)


PREFIX = list(range(1, 13))  # three blocks of 4


# -- exactness ------------------------------------------------------------------------


@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("num_kv_blocks", [20, 512])
@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
@pytest.mark.parametrize("long_prefill_token_threshold", [0, 5])
def test_prefix_caching_with_snapshots_changes_no_output(pipeline_depth, num_kv_blocks,
                                                         scheduling_policy,
                                                         long_prefill_token_threshold):
    rng = random.Random(5)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in (9, 17, 30)]
    requests = random_workload(rng, 32, max_prompt_len=12, num_priorities=3,
                               shared_prefixes=prefixes)
    threshold = 1 if scheduling_policy == "priority" else None
    runs = {enabled: run_hybrid(requests, num_kv_blocks, pipeline_depth=pipeline_depth,
                                scheduling_policy=scheduling_policy,
                                priority_preemption_threshold=threshold,
                                long_prefill_token_threshold=long_prefill_token_threshold,
                                enable_prefix_caching=enabled)
            for enabled in (False, True)}
    assert_reference_outputs(runs[True], requests)
    assert runs[True].outputs == runs[False].outputs
    assert runs[True].finishes == runs[False].finishes
    largest_chunk = max(len(scheduled.token_ids) for run in runs.values()
                        for batch in run.model.batches for scheduled in batch.requests)
    if long_prefill_token_threshold:  # the cap holds, and is reached
        assert largest_chunk == long_prefill_token_threshold
    else:
        assert largest_chunk > 5
    cached = runs[True].scheduler.statistics()
    uncached = runs[False].scheduler.statistics()
    # (recomputed requests restore too, but only first starts are counted)
    assert runs[True].model.num_restored_tokens >= cached.num_prefix_cache_hits > 0
    assert cached.num_prefix_cache_hits < cached.num_prefix_cache_queries
    if num_kv_blocks == 512:
        # (With 20 blocks, caching preempts more: chunks cut for snapshots leave
        # budget for more admissions, and more running requests share too few blocks.)
        assert cached.num_prompt_tokens < uncached.num_prompt_tokens
    assert uncached.num_prefix_cache_hits == 0 and runs[False].model.num_saves == 0
    if num_kv_blocks == 20:
        assert cached.num_preemptions > 0


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_depth_one_and_two_give_the_same_tokens_and_hits(pipeline_depth):
    rng = random.Random(8)
    requests = random_workload(rng, 24, max_prompt_len=10, shared_prefixes=[PREFIX])
    runs = [run_hybrid(requests, pipeline_depth=depth) for depth in (1, 2)]
    assert runs[0].outputs == runs[1].outputs
    assert_reference_outputs(runs[1], requests)


def test_without_snapshot_slots_a_hybrid_model_never_hits():
    """Cached blocks alone are no prefix for it: the state at their end is missing."""
    requests = [make_request(f"r{index}", PREFIX + [40 + index], arrival_index=index)
                for index in range(4)]
    driver = run_hybrid(requests, num_snapshots=0, pipeline_depth=1, max_num_seqs=1)
    statistics = driver.scheduler.statistics()
    assert statistics.num_prefix_cache_hits == 0 and driver.model.num_saves == 0
    assert statistics.num_total_state_slots == 1
    assert_reference_outputs(driver, requests)


# -- where snapshots are taken, and hits -----------------------------------------------


def test_a_hit_is_the_longest_cached_prefix_with_a_snapshot_at_its_end():
    first = make_request("first", PREFIX + [30, 31], max_tokens=2)
    driver = run_hybrid([first], pipeline_depth=1)
    # Its prompt's last full block ends at 12: its state there was saved.
    assert driver.scheduler.statistics().num_state_snapshots == 1
    second = make_request("second", PREFIX + [30, 31, 32, 33, 34], max_tokens=2,
                          arrival_index=1)
    driver.submit(second)
    driver.run()
    (_, chunk), *_ = chunks_of(driver, "second")
    # Blocks of 4: 4 blocks are cached (12 prompt tokens, then 30, 31 and first's 2
    # outputs, but its outputs differ from 32, 33), 3 have a snapshot at their end.
    assert chunk.num_computed_tokens == 12
    assert driver.model.num_restored_tokens == 12
    assert driver.scheduler.statistics().num_prefix_cache_hits == 12
    assert_reference_outputs(driver, [first, second])


def test_a_request_past_its_best_snapshot_ends_its_first_chunk_at_the_branch_point():
    """vLLM's prefix_repetition: prompts share a prefix, then diverge. The second
    one's cached blocks reach the branch point, its snapshots do not: it computes
    from the start, but its first chunk ends there so the third one starts there."""
    requests = [make_request(f"r{index}", PREFIX + [40 + index] * 6, max_tokens=2,
                             arrival_index=index) for index in range(3)]
    driver = run_hybrid(requests[:1], pipeline_depth=1)
    driver.submit(requests[1])
    driver.run()
    second_chunks = chunks_of(driver, "r1")
    assert second_chunks[0][1].num_computed_tokens == 0
    assert len(second_chunks[0][1].token_ids) == 12  # cut at the branch point
    assert second_chunks[1][1].num_computed_tokens == 12
    driver.submit(requests[2])
    driver.run()
    (_, third), *_ = chunks_of(driver, "r2")
    assert third.num_computed_tokens == 12 and driver.model.num_restored_tokens == 12
    assert_reference_outputs(driver, requests)


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_request_waits_a_batch_for_the_state_its_batch_saves_at_the_branch_point(
        pipeline_depth):
    """After a first prompt, two more with its prefix arrive together: the second
    finds the prefix's blocks but no state there, computes it and cuts at the branch
    point; the third, rather than recompute the shared part beside it, starts the
    next batch from the state saved there."""
    requests = [make_request(f"r{index}", PREFIX + [40 + index] * 6, max_tokens=2,
                             arrival_index=index) for index in range(3)]
    driver = run_hybrid(requests[:1], pipeline_depth=pipeline_depth, max_num_batched_tokens=64)
    driver.submit(*requests[1:])
    driver.run()
    (second_step, second), *_ = chunks_of(driver, "r1")
    (third_step, third), *_ = chunks_of(driver, "r2")
    assert second.num_computed_tokens == 0
    assert len(second.token_ids) == len(PREFIX)  # cut at the branch point
    assert third_step == second_step + 1 and third.num_computed_tokens == len(PREFIX)
    assert driver.model.num_restored_tokens == len(PREFIX)
    assert driver.scheduler.statistics().num_prefix_cache_hits == len(PREFIX)
    assert_reference_outputs(driver, requests)


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_prompts_arriving_together_on_one_prefix_compute_it_once(pipeline_depth):
    """Three prompts with a shared prefix arrive together, none of it cached: the
    first finds the prefix shared with those pulled behind it and cuts there; the
    others wait a batch and start from the state saved there."""
    requests = [make_request(f"r{index}", PREFIX + [40 + index] * 6, max_tokens=2,
                             arrival_index=index) for index in range(3)]
    driver = run_hybrid(requests, pipeline_depth=pipeline_depth, max_num_batched_tokens=64)
    first_chunks = [chunks_of(driver, f"r{index}")[0] for index in range(3)]
    (first_step, first), *later = first_chunks
    assert first.num_computed_tokens == 0 and len(first.token_ids) == len(PREFIX)
    assert [step for step, _ in later] == [first_step + 1] * 2
    assert [chunk.num_computed_tokens for _, chunk in later] == [len(PREFIX)] * 2
    assert driver.model.num_restored_tokens == 2 * len(PREFIX)
    assert driver.scheduler.statistics().num_prefix_cache_hits == 2 * len(PREFIX)
    assert_reference_outputs(driver, requests)


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=24),
       others=st.lists(st.lists(st.integers(1, 3), max_size=24), max_size=4),
       block_size=st.sampled_from([1, 2, 4]))
def test_the_shared_prefix_is_the_longest_whole_block_run_any_follower_starts_with(
        prompt, others, block_size):
    def waiting(token_ids):
        return WaitingRequest(request=make_request("r", token_ids or [1]))
    expected = 0
    for other in others:
        common = 0
        while (common < min(len(prompt), len(other or [1]))
               and prompt[common] == (other or [1])[common]):
            common += 1
        expected = max(expected, common // block_size * block_size)
    followers = [waiting(other) for other in others]
    assert _num_tokens_shared(waiting(prompt), followers, block_size) == expected


def test_a_branch_point_found_ahead_is_kept_over_prompt_ends_saved_beside_it():
    """Two snapshot slots: the first prompt's cut where it shares a prefix with those
    behind it is saved in the same batch as three unrelated prompts' ends; it is a
    shared snapshot from its save, so the prompt ends push each other out, not it,
    and the two prompts behind start there."""
    first = make_request("r0", PREFIX + [40] * 6, max_tokens=2)
    unrelated = [make_request(f"x{index}", [60 + index] * 17, max_tokens=2,
                              arrival_index=1 + index) for index in range(3)]
    behind = [make_request(f"r{index}", PREFIX + [40 + index] * 6, max_tokens=2,
                           arrival_index=3 + index) for index in (1, 2)]
    driver = run_hybrid([first, *unrelated, *behind], num_snapshots=2, pipeline_depth=1,
                        max_num_batched_tokens=256)
    assert [chunks_of(driver, request.request_id)[0][1].num_computed_tokens
            for request in behind] == [len(PREFIX)] * 2
    assert_reference_outputs(driver, [first, *unrelated, *behind])


def test_only_a_follower_with_the_same_cache_salt_makes_a_cut():
    """The same prompts under two salts: nothing is shared across them, so the first
    prompt's first chunk runs to its prompt's last full block."""
    requests = [make_request("r0", PREFIX + [40] * 6, max_tokens=2),
                make_request("r1", PREFIX + [41] * 6, max_tokens=2, arrival_index=1,
                             cache_salt="other")]
    driver = run_hybrid(requests, pipeline_depth=1, max_num_batched_tokens=64)
    (_, first), *_ = chunks_of(driver, "r0")
    assert len(first.token_ids) == 16
    assert driver.scheduler.statistics().num_prefix_cache_hits == 0
    assert_reference_outputs(driver, requests)


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_the_same_prompt_arriving_together_is_computed_once(pipeline_depth):
    """As the choices of one request (``n``) arrive: the first computes the prompt,
    the others start from its state at the prompt's last full block a batch later."""
    requests = [make_request(f"r{index}", PREFIX + [50], max_tokens=3, seed=index,
                             arrival_index=index) for index in range(3)]
    driver = run_hybrid(requests, pipeline_depth=pipeline_depth, max_num_batched_tokens=64)
    first_chunks = [chunks_of(driver, f"r{index}")[0] for index in range(3)]
    assert [step for step, _ in first_chunks] == [0, 1, 1]
    assert [chunk.num_computed_tokens for _, chunk in first_chunks] == [0, 12, 12]
    assert driver.model.num_restored_tokens == 24
    assert_reference_outputs(driver, requests)


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_burst_waits_for_chunk_seats_rather_than_start_without_its_prefix(pipeline_depth):
    """Eight distinct prompts take the step's chunk seats; three more on a prefix of
    their own arrive with them. Rather than start with one-token chunks from an empty
    state (each would compute the whole shared part, a token a batch), they wait for a
    seat: the first of them computes the prefix and cuts at the branch point, the
    other two start there."""
    def prompt(index: int) -> list[int]:
        return [(index * 18 + j) % VOCAB_SIZE + 1 for j in range(18)]
    distinct = [make_request(f"r{index}", prompt(index), max_tokens=2, arrival_index=index)
                for index in range(MAX_CHUNKED_SEQS)]
    followers = [make_request(f"f{index}", prompt(50)[:12] + [90 + index] * 6, max_tokens=2,
                              arrival_index=MAX_CHUNKED_SEQS + index) for index in range(3)]
    driver = run_hybrid(distinct + followers, pipeline_depth=pipeline_depth,
                        max_num_seqs=16, max_num_batched_tokens=256)
    first_chunks = [chunks_of(driver, f"f{index}")[0][1] for index in range(3)]
    assert all(len(chunk.token_ids) > 1 for chunk in first_chunks)
    assert [chunk.num_computed_tokens for chunk in first_chunks] == [0, 12, 12]
    assert driver.scheduler.statistics().num_prefix_cache_hits == 24
    assert_reference_outputs(driver, distinct + followers)


def test_a_prompt_with_no_block_to_hit_starts_at_once_beside_taken_chunk_seats():
    """Behind eight prompts that take the chunk seats, a prompt with less than a block
    before its last token (no hit could ever shorten it) starts in the same batch with
    a one-token chunk; one with a whole block left waits for a seat."""
    def prompt(index: int, length: int) -> list[int]:
        return [(index * 18 + j) % VOCAB_SIZE + 1 for j in range(length)]
    # (17 tokens: a chunk to the last full block, then the last token alone, seatless)
    distinct = [make_request(f"r{index}", prompt(index, 17), max_tokens=2, arrival_index=index)
                for index in range(MAX_CHUNKED_SEQS)]
    short = make_request("short", prompt(40, 4), max_tokens=2, arrival_index=8)  # block: 4
    longer = make_request("longer", prompt(41, 5), max_tokens=2, arrival_index=9)
    driver = run_hybrid([*distinct, short, longer], pipeline_depth=1, max_num_seqs=16,
                        max_num_batched_tokens=256)
    (short_step, short_chunk), *_ = chunks_of(driver, "short")
    (longer_step, longer_chunk), *_ = chunks_of(driver, "longer")
    assert short_step == 0 and len(short_chunk.token_ids) == 1
    assert longer_step == 1 and len(longer_chunk.token_ids) > 1
    assert_reference_outputs(driver, [*distinct, short, longer])


def test_a_branch_point_outlives_the_prompt_ends_saved_after_it():
    """Two snapshot slots: a shared prefix's branch point is kept while the prompt ends
    of four unrelated requests come and go, and a later prompt on that prefix starts
    there (one LRU order over all snapshots would have lost it to the second one)."""
    driver = run_hybrid([make_request("r0", PREFIX + [40] * 6, max_tokens=2)],
                        num_snapshots=2, pipeline_depth=1)
    for index, tail in enumerate([[41] * 6, *([60 + n] * 18 for n in range(4))], start=1):
        driver.submit(make_request(f"r{index}", PREFIX + tail if index == 1 else tail,
                                   max_tokens=2, arrival_index=index))
        driver.run()
    driver.submit(make_request("last", PREFIX + [42] * 6, max_tokens=2, arrival_index=9))
    driver.run()
    assert chunks_of(driver, "last")[0][1].num_computed_tokens == len(PREFIX)


def test_a_dense_model_never_waits_for_a_state():
    """Its requests share the prefix's KV blocks within the batch that computes them."""
    requests = [make_request(f"r{index}", PREFIX + [40 + index] * 6, max_tokens=2,
                             arrival_index=index) for index in range(3)]
    driver = Driver(config(pipeline_depth=1, max_num_batched_tokens=64), 512)
    driver.submit(*requests)
    driver.run()
    first_chunks = [chunks_of(driver, f"r{index}")[0] for index in range(3)]
    assert [step for step, _ in first_chunks] == [0, 0, 0]
    assert [chunk.num_computed_tokens for _, chunk in first_chunks] == [0, 12, 12]
    assert_reference_outputs(driver, requests)


def test_the_save_copy_follows_the_chunk_in_the_next_batch_at_depth_two():
    driver = HybridDriver(config(pipeline_depth=2), 64, 8 + 4)
    driver.submit(make_request("r", PREFIX + [50], max_tokens=4))
    first_batch = driver.plan()
    second_batch = driver.plan()  # planned while the first is in flight
    assert first_batch is not None and second_batch is not None
    assert first_batch.state_copies == []
    slot = first_batch.new_requests[0].state_slot
    (source, destination), = second_batch.state_copies
    assert source == slot and destination != slot
    driver.run()
    assert driver.model.num_saves == 1


def test_a_request_that_leaves_before_the_next_batch_saves_no_snapshot():
    driver = HybridDriver(config(pipeline_depth=1), 64, 8 + 4)
    driver.submit(make_request("r", PREFIX + [50, 51], max_tokens=4),
                  # (its decodes reach no block boundary: no snapshot of its own)
                  make_request("other", [60, 61], max_tokens=2, arrival_index=1))
    driver.plan()
    driver.complete()
    driver.abort("r")
    batch = driver.plan()
    assert batch is not None and batch.state_copies == [] and batch.finished_request_ids == ["r"]
    driver.run()
    assert driver.scheduler.statistics().num_state_snapshots == 0


def test_prompt_lengths_on_a_block_boundary_save_at_the_prompts_end():
    requests = [make_request(f"r{index}", PREFIX, max_tokens=3, arrival_index=index)
                for index in range(3)]
    driver = run_hybrid(requests[:1], pipeline_depth=1)
    # The state after the whole prompt is saved; a hit must leave a token to
    # compute, so the next identical prompt can start only at 8: its first chunk
    # ends there for a snapshot, which the third one starts from.
    driver.submit(requests[1])
    driver.run()
    assert chunks_of(driver, "r1")[0][1].num_computed_tokens == 0
    driver.submit(requests[2])
    driver.run()
    assert chunks_of(driver, "r2")[0][1].num_computed_tokens == 8
    assert_reference_outputs(driver, requests)


def test_the_least_recently_used_snapshot_goes_first():
    prompts = [[index] * 8 + [50] for index in range(1, 4)]
    requests = [make_request(f"r{index}", prompt, max_tokens=1, arrival_index=index)
                for index, prompt in enumerate(prompts)]
    driver = run_hybrid(requests, num_snapshots=2, pipeline_depth=1, max_num_seqs=1)
    assert driver.scheduler.statistics().num_state_snapshots == 2
    assert driver.scheduler.state_slots is not None
    assert driver.scheduler.state_slots.num_snapshot_evictions == 1
    # Newest first (oldest first would evict each one's snapshot just before it is
    # asked for: a miss saves one): the first prompt's snapshot was evicted, the
    # other two hit theirs.
    again = [make_request(f"again{index}", prompt + [51], max_tokens=1, arrival_index=20 - index)
             for index, prompt in enumerate(prompts)]
    driver.submit(*reversed(again))
    driver.run()
    assert [chunks_of(driver, f"again{index}")[0][1].num_computed_tokens
            for index in range(3)] == [0, 8, 8]


def test_a_snapshot_serves_a_request_admitted_in_the_batch_that_saves_it():
    driver = HybridDriver(config(pipeline_depth=1), 64, 8 + 4)
    first = make_request("a", PREFIX[:8] + [50], max_tokens=3)
    driver.submit(first)
    driver.plan()  # a's first chunk ends at its prompt's last full block
    driver.complete()
    second = make_request("b", PREFIX[:8] + [51], max_tokens=2, arrival_index=1)
    driver.submit(second)
    batch = driver.plan()
    assert batch is not None
    (a_slot, saved_into), (restored_from, b_slot) = batch.state_copies
    assert a_slot == slot_of(driver, "a") and restored_from == saved_into
    assert [new.state_slot for new in batch.new_requests] == [b_slot]
    driver.run()
    assert driver.model.num_restored_tokens == 8
    assert_reference_outputs(driver, [first, second])


def test_a_snapshot_a_save_evicts_is_no_hit_in_that_batch():
    """One snapshot slot: the batch's save evicts the snapshot a request admitted
    in the same batch would have restored; it computes its prefix instead."""
    driver = run_hybrid([make_request("a", PREFIX[:8] + [50], max_tokens=1)], num_snapshots=1,
                        pipeline_depth=1)
    driver.submit(make_request("c", [60] * 8 + [61], max_tokens=2, arrival_index=1))
    driver.plan()  # c's first chunk ends at its prompt's last full block
    driver.complete()
    driver.submit(make_request("b", PREFIX[:8] + [51], max_tokens=2, arrival_index=2))
    batch = driver.plan()
    assert batch is not None
    (c_slot, _), = batch.state_copies  # c's save, no restore
    assert c_slot == slot_of(driver, "c")
    b_chunk, = [scheduled for scheduled in batch.requests if scheduled.request_id == "b"]
    assert b_chunk.num_computed_tokens == 0
    driver.run()
    assert_reference_outputs(driver, [make_request("b", PREFIX[:8] + [51], max_tokens=2),
                                      make_request("c", [60] * 8 + [61], max_tokens=2)])


def test_a_save_whose_batch_never_comes_is_forgotten():
    """At depth 2 a request whose prompt ends on a block boundary and wants one token
    has nothing to run in the next plan: no batch carries its save, so no snapshot
    may stay registered; and it finished before a later batch could."""
    driver = HybridDriver(config(pipeline_depth=2), 64, 8 + 4)
    driver.submit(make_request("r", PREFIX[:8], max_tokens=1))
    assert driver.plan() is not None
    assert driver.plan() is None  # its token is still in flight
    assert driver.scheduler.statistics().num_state_snapshots == 0
    driver.run()
    assert driver.scheduler.statistics().num_state_snapshots == 0
    assert driver.model.num_saves == 0


def test_saves_of_one_batch_that_never_comes_are_forgotten_though_one_evicted_another():
    """The same with two such requests and one snapshot slot: the second save evicts the
    first (its slot reused), so only the second is left to forget, and the slot goes
    back (found by the random multi-turn test)."""
    driver = HybridDriver(config(pipeline_depth=2), 64, 8 + 1)
    driver.submit(make_request("r", PREFIX[:8], max_tokens=1),
                  make_request("s", [60] * 8, max_tokens=1, arrival_index=1))
    assert driver.plan() is not None
    assert driver.plan() is None  # both tokens are still in flight
    state_slots = driver.scheduler.state_slots
    assert state_slots is not None and state_slots.num_snapshot_evictions == 1
    assert driver.scheduler.statistics().num_state_snapshots == 0
    assert state_slots.num_free_slots == 8 + 1 - 2  # r and s still hold theirs
    driver.run()
    assert driver.scheduler.statistics().num_state_snapshots == 0
    assert driver.model.num_saves == 0


def test_a_snapshot_whose_blocks_were_evicted_is_no_hit():
    first = make_request("first", PREFIX + [50], max_tokens=1)
    # 4 KV blocks: the next request needs all of them, so first's cached blocks go.
    driver = run_hybrid([first], num_kv_blocks=4, pipeline_depth=1, max_num_seqs=1)
    driver.submit(make_request("filler", [60] * 13, max_tokens=2, arrival_index=1))
    driver.run()
    assert driver.scheduler.statistics().num_state_snapshots >= 1
    driver.submit(make_request("again", PREFIX + [51], max_tokens=1, arrival_index=2))
    driver.run()
    assert chunks_of(driver, "again")[0][1].num_computed_tokens == 0
    assert driver.scheduler.statistics().num_prefix_cache_hits == 0


def test_only_requests_with_the_same_cache_salt_share_snapshots():
    first = make_request("first", PREFIX + [50], max_tokens=1, cache_salt="a")
    driver = run_hybrid([first], pipeline_depth=1)
    driver.submit(make_request("other", PREFIX + [51], max_tokens=1, arrival_index=1,
                               cache_salt="b"),
                  make_request("same", PREFIX + [52], max_tokens=1, arrival_index=2,
                               cache_salt="a"))
    driver.run()
    assert chunks_of(driver, "other")[0][1].num_computed_tokens == 0
    assert chunks_of(driver, "same")[0][1].num_computed_tokens == 12


# -- snapshots taken during decode (multi-turn) ----------------------------------------


def next_turn(request: Any, request_id: str, new_token_ids: list[int], arrival_index: int,
              max_tokens: int = 3) -> Any:
    """The next turn of a conversation: its prompt, its (reference) answer, new tokens."""
    answer, _, _ = reference_output(request)
    return make_request(request_id, request.prompt_token_ids + answer + new_token_ids,
                        max_tokens=max_tokens, arrival_index=arrival_index)


def copies_from(driver: Driver, request_id: str) -> list[tuple[int, tuple[int, int]]]:
    """(step id, copy) of every copy out of the request's (first) running slot."""
    slot = slot_of(driver, request_id)
    return [(batch.step_id, copy) for batch in driver.model.batches
            for copy in batch.state_copies if copy[0] == slot]


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_decode_leaves_one_snapshot_at_its_last_block_boundary(pipeline_depth):
    """Its prompt is shorter than a block (no prompt snapshot); its decodes reach 4, 8,
    12 and 16 computed tokens: each state is copied into one pending slot, in the batch
    after the boundary's; when it finishes (17 computed), the slot holds the state at 16
    and is registered. The next turn starts there, past the whole first answer."""
    first = make_request("first", [1, 2, 3], max_tokens=15)
    driver = run_hybrid([first], pipeline_depth=pipeline_depth)
    copies = copies_from(driver, "first")
    assert len(copies) == 4 and len({destination for _, (_, destination) in copies}) == 1
    boundary_steps = [step_id for step_id, scheduled in chunks_of(driver, "first")
                      if (scheduled.num_computed_tokens + max(len(scheduled.token_ids), 1)) % 4
                      == 0]
    assert [step_id for step_id, _ in copies] == [step_id + 1 for step_id in boundary_steps]
    statistics = driver.scheduler.statistics()
    assert statistics.num_state_snapshots == 1
    second = next_turn(first, "second", [40, 41], arrival_index=1)
    driver.submit(second)
    driver.run()
    assert chunks_of(driver, "second")[0][1].num_computed_tokens == 16
    assert driver.model.num_restored_tokens == 16
    assert driver.scheduler.statistics().num_prefix_cache_hits == 16
    assert_reference_outputs(driver, [first, second])


@pytest.mark.parametrize("interval", [6, 8])
def test_decodes_save_their_state_every_interval_in_whole_blocks(interval):
    """An interval of 6 or 8 tokens at blocks of 4 saves at 8 and 16 computed tokens
    (6 rounds up to 8): half the copies of every block, the same snapshot at the end."""
    first = make_request("first", [1, 2, 3], max_tokens=15)
    driver = run_hybrid([first], decode_snapshot_interval=interval)
    assert len(copies_from(driver, "first")) == 2
    second = next_turn(first, "second", [40, 41], arrival_index=1)
    driver.submit(second)
    driver.run()
    assert driver.model.num_restored_tokens == 16
    assert_reference_outputs(driver, [first, second])


@pytest.mark.parametrize("way_out", ["abort", "stop string"])
def test_a_request_leaving_early_registers_its_pending_snapshot(way_out):
    """Aborted or stopped by a stop string past a few block boundaries: its last saved
    boundary becomes a snapshot, where a next turn starts; its slots are all back."""
    driver = HybridDriver(config(pipeline_depth=2), 64, 8 + 2)
    driver.submit(make_request("r", [1, 2, 3], max_tokens=30))
    for _ in range(24):  # 3 computed, then about 10 decodes: boundaries 4, 8 and 12
        driver.run_once()
    assert driver.scheduler.statistics().num_pending_state_snapshots == 1
    if way_out == "abort":
        driver.abort("r")
    else:
        driver.scheduler.on_stop_string_hit("r")
    driver.run()
    assert driver.scheduler.statistics().num_state_snapshots == 1
    output = driver.outputs["r"]
    follow_up = make_request("next", [1, 2, 3] + output + [40], max_tokens=2, arrival_index=1)
    driver.submit(follow_up)
    driver.run()
    num_computed = chunks_of(driver, "next")[0][1].num_computed_tokens
    assert num_computed >= 12 and num_computed == driver.model.num_restored_tokens
    assert_reference_outputs(driver, [follow_up])


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_preempted_request_restarts_from_its_pending_snapshot(pipeline_depth):
    """6 KV blocks for two requests that need 4 each: the later one is preempted after
    its decodes passed a block boundary; its pending snapshot is registered then, and
    its recompute (prompt + output so far) starts there instead of from zero."""
    requests = [make_request("early", [1, 2, 3], max_tokens=14),
                make_request("late", [4, 5, 6], max_tokens=14, arrival_index=1)]
    driver = run_hybrid(requests, num_kv_blocks=6, pipeline_depth=pipeline_depth)
    assert driver.preempted == ["late"]
    restarts = [scheduled for _, scheduled in chunks_of(driver, "late")[1:]
                if len(scheduled.token_ids) > 1]
    assert restarts and restarts[0].num_computed_tokens == 8
    assert driver.model.num_restored_tokens == 8
    assert_reference_outputs(driver, requests)


def test_pending_slots_never_exceed_the_snapshot_share():
    """One snapshot slot and two decoding requests: the first to reach a boundary
    takes it (evicting nothing: it is free), the other takes no snapshot; the
    tokens are the reference's and every slot comes back."""
    requests = [make_request(f"r{index}", [index + 1] * 3, max_tokens=12, arrival_index=index)
                for index in range(2)]
    driver = HybridDriver(config(pipeline_depth=2), 64, 8 + 1)
    driver.submit(*requests)
    pending = []
    while driver.run_once():
        statistics = driver.scheduler.statistics()
        pending.append(statistics.num_pending_state_snapshots)
        assert statistics.num_pending_state_snapshots + statistics.num_state_snapshots <= 1
    driver.check_idle()
    assert max(pending) == 1
    assert driver.scheduler.statistics().num_state_snapshots == 1
    assert_reference_outputs(driver, requests)


def test_a_pending_slot_evicts_the_least_recently_used_snapshot():
    """One snapshot slot, holding a prompt's snapshot: the next request's first decode
    boundary takes it for its pending snapshot, which its next turn then starts from."""
    first = make_request("first", PREFIX[:8] + [50], max_tokens=1)
    driver = run_hybrid([first], num_snapshots=1, pipeline_depth=1)
    assert driver.scheduler.statistics().num_state_snapshots == 1  # at 8, the prompt's
    # (7 tokens: 9 computed, boundaries 4 and 8; the one its last computed token
    # reaches would not be saved, no batch follows it)
    second = make_request("second", [60, 61, 62], max_tokens=7, arrival_index=1)
    driver.submit(second)
    driver.run()
    assert driver.scheduler.state_slots is not None
    assert driver.scheduler.state_slots.num_snapshot_evictions == 1
    driver.submit(next_turn(second, "third", [40], arrival_index=2))
    driver.run()
    assert chunks_of(driver, "third")[0][1].num_computed_tokens == 8


def test_a_boundary_another_request_registered_first_keeps_its_snapshot():
    """Two identical requests decode side by side: both hold a pending snapshot of
    the same prefix; the second to stop finds it registered and frees its slot."""
    requests = [make_request(f"r{index}", [7, 8, 9], max_tokens=10, arrival_index=index)
                for index in range(2)]
    driver = run_hybrid(requests, pipeline_depth=2)
    assert driver.outputs["r0"] == driver.outputs["r1"]
    pending_slots = [{destination for _, (_, destination) in copies_from(driver, request_id)}
                     for request_id in ("r0", "r1")]
    assert all(len(slots) == 1 for slots in pending_slots) and pending_slots[0] != pending_slots[1]
    assert driver.scheduler.statistics().num_state_snapshots == 1
    assert_reference_outputs(driver, requests)


@pytest.mark.parametrize("pipeline_depth", [1, 2])
@pytest.mark.parametrize("num_kv_tokens", [96, 2048])
@pytest.mark.parametrize("block_size", [1, 4])
def test_multi_turn_conversations_hit_their_previous_answers(pipeline_depth, num_kv_tokens,
                                                              block_size):
    """Conversations of three turns (each prompt is the previous prompt, its answer and
    new tokens), interleaved with one another; with a small KV cache, preempted. The
    tokens are the reference's, and the hits cover the previous answers: more than
    the previous prompts' full blocks. (Blocks of 1: every decode saves a state.)"""
    rng = random.Random(11)
    engine_config = config(pipeline_depth=pipeline_depth, block_size=block_size)
    driver = HybridDriver(engine_config, num_kv_tokens // block_size,
                          engine_config.max_num_seqs + 8)
    turns = [make_request(f"c{index}t0", [rng.randrange(VOCAB_SIZE)
                                          for _ in range(rng.randint(2, 9))],
                          max_tokens=rng.randint(6, 12), arrival_index=index)
             for index in range(4)]
    num_prompt_blocks_tokens = 0  # what the hits could reach with prompt snapshots only
    for turn in range(1, 3):
        driver.submit(*turns)
        driver.run()
        assert_reference_outputs(driver, turns)
        num_prompt_blocks_tokens += sum(len(previous.prompt_token_ids) // block_size
                                        * block_size for previous in turns)
        turns = [next_turn(previous, f"c{index}t{turn}",
                           [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 5))],
                           arrival_index=10 * turn + index, max_tokens=rng.randint(6, 12))
                 for index, previous in enumerate(turns)]
    driver.submit(*turns)
    driver.run()
    assert_reference_outputs(driver, turns)
    statistics = driver.scheduler.statistics()
    assert statistics.num_prefix_cache_hits > num_prompt_blocks_tokens
    if num_kv_tokens == 96:
        assert statistics.num_preemptions > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4]),
    max_num_batched_tokens=st.integers(1, 32),
    max_num_seqs=st.integers(1, 4),
    num_snapshots=st.integers(0, 4),
    num_kv_tokens=st.sampled_from([48, 512]),  # the longest turn needs 38
    pipeline_depth=st.sampled_from([1, 2]),
)
def test_random_multi_turn_schedules_match_the_reference(
        seed, block_size, max_num_batched_tokens, max_num_seqs, num_snapshots,
        num_kv_tokens, pipeline_depth):
    """Four conversations of three turns, each turn arriving at a random time after the
    one before finished: decode snapshots taken, refreshed, registered, evicted and
    restored under every configuration give the reference tokens, and no slot leaks."""
    rng = random.Random(seed)
    conversations = []
    for index in range(4):
        turn = make_request(f"c{index}t0", [rng.randrange(VOCAB_SIZE)
                                            for _ in range(rng.randint(1, 6))],
                            max_tokens=rng.randint(1, 10), arrival_index=index)
        conversation = [turn]
        for number in range(1, 3):
            turn = next_turn(turn, f"c{index}t{number}", [rng.randrange(VOCAB_SIZE)],
                             arrival_index=10 * number + index, max_tokens=rng.randint(1, 10))
            conversation.append(turn)
        conversations.append(deque(conversation))
    all_turns = [turn for conversation in conversations for turn in conversation]
    driver = HybridDriver(config(block_size=block_size, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 pipeline_depth=pipeline_depth),
                          num_kv_tokens // block_size, max_num_seqs + num_snapshots)
    last_turn_ids: list[str | None] = [None] * len(conversations)
    for _ in range(100_000):
        for index, conversation in enumerate(conversations):
            last_turn_id = last_turn_ids[index]
            is_ready = last_turn_id is None or last_turn_id in driver.finishes
            if conversation and is_ready and rng.random() < 0.3:
                turn = conversation.popleft()
                driver.submit(turn)
                last_turn_ids[index] = turn.request_id
        if not driver.run_once() and not any(conversations):
            break
    driver.check_idle()
    assert_reference_outputs(driver, all_turns)


# -- slots: one per running sequence, freed on every way out -------------------------------


def test_every_running_sequence_holds_its_own_slot():
    requests = [make_request(f"r{index}", [index + 1] * 5, max_tokens=6, arrival_index=index)
                for index in range(8)]
    driver = run_hybrid(requests, pipeline_depth=2)
    slots = [new.state_slot for batch in driver.model.batches for new in batch.new_requests]
    assert len(slots) == 8 and len(set(slots)) == 8  # all ran at once: 8 seats
    assert driver.max_num_running == 8


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_slots_are_freed_on_finish_abort_and_stop_string(pipeline_depth):
    driver = HybridDriver(config(pipeline_depth=pipeline_depth), 64, 8 + 2)
    driver.submit(make_request("done", [1, 2], max_tokens=2),
                  make_request("aborted", [3, 4], max_tokens=30, arrival_index=1),
                  make_request("stopped", [5, 6], max_tokens=30, arrival_index=2))
    for _ in range(6):
        driver.run_once()
    total = driver.scheduler.statistics().num_total_state_slots
    assert driver.scheduler.statistics().num_free_state_slots < total
    driver.abort("aborted")
    driver.scheduler.on_stop_string_hit("stopped")
    driver.run()  # check_idle: every slot is free or a snapshot's
    assert driver.finishes["done"][0] == "length"


def test_a_preempted_request_gives_its_slot_back_and_gets_one_again():
    driver = run_hybrid([make_request("early", [1] * 4, max_tokens=8),
                         make_request("late", [2] * 4, max_tokens=8, arrival_index=1)],
                        num_kv_blocks=4, pipeline_depth=1)
    assert driver.preempted == ["late"]
    lives = [new.state_slot for batch in driver.model.batches for new in batch.new_requests
             if new.request_id == "late"]
    assert len(lives) == 2 and all(slot is not None for slot in lives)


def test_the_scheduler_refuses_fewer_slots_than_seats():
    with pytest.raises(ValueError, match="fewer than max_num_seqs"):
        Scheduler(config(max_num_seqs=8), 64, num_state_slots=7)


@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_a_step_holds_at_most_max_chunked_seqs_chunks_of_two_tokens_or_more(pipeline_depth):
    """Twelve prompts at once with budget for all: a hybrid model's first step prefills
    MAX_CHUNKED_SEQS of them and gives the others one token each (their states update in
    place), no step holds more, and the outputs are the reference's; a dense model's
    first step prefills all twelve."""
    num_requests, prompt_len = MAX_CHUNKED_SEQS + 4, 10
    requests = [make_request(f"r{i}", [(i * prompt_len + j) % VOCAB_SIZE + 1
                                       for j in range(prompt_len)], arrival_index=i)
                for i in range(num_requests)]
    # (no prefix caching: its snapshot cuts would end chunks early)
    overrides = dict(max_num_seqs=num_requests, max_num_batched_tokens=256,
                     pipeline_depth=pipeline_depth, enable_prefix_caching=False)
    hybrid = run_hybrid(requests, **overrides)
    assert_reference_outputs(hybrid, requests)
    first = hybrid.model.batches[0]
    assert [len(scheduled.token_ids) for scheduled in first.requests] == \
        [prompt_len] * MAX_CHUNKED_SEQS + [1] * (num_requests - MAX_CHUNKED_SEQS)
    assert max(num_chunks_of_two_or_more(batch)
               for batch in hybrid.model.batches) == MAX_CHUNKED_SEQS
    dense = Driver(config(**overrides), 512)
    dense.submit(*requests)
    dense.run()
    assert_reference_outputs(dense, requests)
    assert num_chunks_of_two_or_more(dense.model.batches[0]) == num_requests


def test_a_dense_model_gets_no_slots_and_no_copies():
    driver = Driver(config(), 64)
    driver.submit(*[make_request(f"r{i}", PREFIX + [i], arrival_index=i) for i in range(3)])
    driver.run()
    assert all(new.state_slot is None for batch in driver.model.batches
               for new in batch.new_requests)
    assert all(batch.state_copies == [] for batch in driver.model.batches)
    assert driver.scheduler.statistics().num_total_state_slots == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_spare_blocks=st.integers(0, 12),
    max_num_batched_tokens=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    num_snapshots=st.integers(0, 4),
    pipeline_depth=st.sampled_from([1, 2]),
    scheduling_policy=st.sampled_from(["fcfs", "priority"]),
    threshold=st.sampled_from([None, 0, 1, 3]),
    num_aborts=st.integers(0, 4),
    enable_prefix_caching=st.booleans(),
    num_shared_prefixes=st.integers(0, 3),
)
def test_random_hybrid_schedules_conserve_slots_and_match_the_reference(
        seed, block_size, num_spare_blocks, max_num_batched_tokens, max_num_seqs, num_snapshots,
        pipeline_depth, scheduling_policy, threshold, num_aborts, enable_prefix_caching,
        num_shared_prefixes):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(1, 12))]
                for _ in range(num_shared_prefixes)]
    requests = random_workload(rng, 12, max_prompt_len=20 - 12 * bool(prefixes),
                               max_output_len=12, num_priorities=4, shared_prefixes=prefixes)
    num_kv_blocks = -(-32 // block_size) + num_spare_blocks  # the longest request fits alone
    driver = HybridDriver(config(block_size=block_size,
                                 max_num_batched_tokens=max_num_batched_tokens,
                                 max_num_seqs=max_num_seqs, pipeline_depth=pipeline_depth,
                                 scheduling_policy=scheduling_policy,
                                 priority_preemption_threshold=threshold,
                                 enable_prefix_caching=enable_prefix_caching),
                          num_kv_blocks, max_num_seqs + num_snapshots)
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
        assert (statistics.num_free_state_slots + statistics.num_state_snapshots
                + statistics.num_pending_state_snapshots + statistics.num_running
                == statistics.num_total_state_slots)
        assert statistics.num_pending_state_snapshots <= statistics.num_running
        if not driver.run_once() and not arrivals and turn > 60:
            break
    driver.check_idle()
    assert set(driver.finishes) == {request.request_id for request in requests}
    for request in requests:
        tokens, finish_reason, stop_reason = reference_output(request)
        output = driver.outputs[request.request_id]
        if driver.finishes[request.request_id][0] == "abort":
            assert request.request_id in aborted and tokens[:len(output)] == output
        else:
            assert output == tokens
            assert driver.finishes[request.request_id] == (finish_reason, stop_reason)
