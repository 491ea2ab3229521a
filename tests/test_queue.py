"""The waiting queue: its ordering policy, its bound, aborts and tombstones, and the actor."""

from typing import Any

import pytest
import trio
import trio.testing

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import QueueFull
from trio_llm.actors.messages import (
    Abort,
    AbortOutcome,
    Admit,
    Pull,
    Pulled,
    Request,
    Requeue,
    SamplingOptions,
    SamplingParams,
    WaitingRequest,
)
from trio_llm.actors.queue import MAX_STALE_HEAP_ENTRIES, WaitingQueue, run_queue
from trio_llm.actors.streams import RequestStreams


def make_request(request_id: str, *, priority: int = 0, arrival_index: int = 0) -> Request:
    sampling = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                               num_logprobs=None, min_tokens=0, banned_token_ids=[])
    return Request(request_id=request_id, prompt_token_ids=[1, 2, 3], params=SamplingParams(),
                   sampling=sampling, stop_token_ids=[], max_tokens=4, priority=priority,
                   arrival_index=arrival_index, arrival_time=0.0)


def ids(requests: list[WaitingRequest]) -> list[str]:
    return [waiting.request.request_id for waiting in requests]


# -- policy -----------------------------------------------------------------------


def test_fcfs_orders_by_arrival_and_ignores_priority():
    queue = WaitingQueue(EngineConfig(scheduling_policy="fcfs"))
    for arrival_index, priority in enumerate([5, -3, 0]):
        queue.admit(make_request(f"r{arrival_index}", priority=priority,
                                 arrival_index=arrival_index))
    assert ids(queue.pop_best(10)) == ["r0", "r1", "r2"]


def test_priority_orders_lower_value_first_then_by_arrival():
    queue = WaitingQueue(EngineConfig(scheduling_policy="priority"))
    for arrival_index, priority in enumerate([1, 0, 1, -2, 0]):
        queue.admit(make_request(f"r{arrival_index}", priority=priority,
                                 arrival_index=arrival_index))
    assert ids(queue.pop_best(2)) == ["r3", "r1"]
    assert ids(queue.pop_best(10)) == ["r4", "r0", "r2"]
    assert queue.statistics().num_waiting == 0


def test_requeued_request_keeps_its_place_before_later_arrivals():
    queue = WaitingQueue(EngineConfig())
    for arrival_index in range(3):
        queue.admit(make_request(f"r{arrival_index}", arrival_index=arrival_index))
    first = queue.pop_best(1)
    queue.admit(make_request("r3", arrival_index=3))
    assert queue.requeue([WaitingRequest(request=first[0].request, output_token_ids=[7],
                                         num_preemptions=1)]) == []
    best = queue.pop_best(10)
    assert ids(best) == ["r0", "r1", "r2", "r3"]
    assert best[0].output_token_ids == [7] and best[0].num_preemptions == 1


def test_bound_applies_to_new_requests_only():
    queue = WaitingQueue(EngineConfig(max_waiting_requests=2))
    assert queue.admit(make_request("a", arrival_index=0))
    assert queue.admit(make_request("b", arrival_index=1))
    assert not queue.admit(make_request("c", arrival_index=2))
    assert "c" not in queue
    queue.requeue([WaitingRequest(request=make_request("d", arrival_index=3))])
    assert queue.statistics().num_waiting == 3


def test_abort_of_a_waiting_request_removes_it():
    queue = WaitingQueue(EngineConfig())
    queue.admit(make_request("a", arrival_index=0))
    queue.admit(make_request("b", arrival_index=1))
    assert queue.abort("a")
    assert ids(queue.pop_best(10)) == ["b"]


def test_abort_of_a_preempted_waiting_request_removes_it_and_leaves_the_finish_to_the_scheduler():
    queue = WaitingQueue(EngineConfig())
    queue.requeue([WaitingRequest(request=make_request("a"), output_token_ids=[3],
                                  num_preemptions=1)])
    assert not queue.abort("a")
    assert "a" not in queue
    queue.forget_abort("a")
    assert not queue._aborts_in_flight


def test_a_dropped_requeue_of_a_preempted_request_is_not_reported():
    queue = WaitingQueue(EngineConfig())
    queue.abort("a")
    preempted = WaitingRequest(request=make_request("a"), num_preemptions=2)
    assert queue.requeue([preempted]) == []
    assert "a" not in queue


def test_abort_of_a_request_not_waiting_drops_its_requeue_until_the_outcome():
    queue = WaitingQueue(EngineConfig())
    assert not queue.abort("a")
    requeued = [WaitingRequest(request=make_request("a")),
                WaitingRequest(request=make_request("b", arrival_index=1))]
    assert queue.requeue(requeued) == ["a"]
    assert ids(queue.pop_best(10)) == ["b"]
    queue.forget_abort("a")
    assert queue.requeue([WaitingRequest(request=make_request("a"))]) == []
    assert "a" in queue


def test_a_request_id_used_again_after_an_abort_is_not_confused_with_the_old_one():
    queue = WaitingQueue(EngineConfig())
    queue.admit(make_request("a", arrival_index=0))
    queue.admit(make_request("b", arrival_index=1))
    queue.abort("a")
    queue.admit(make_request("a", arrival_index=2))
    assert [waiting.request.arrival_index for waiting in queue.pop_best(10)] == [1, 2]


def test_stale_entries_are_dropped_from_the_heap():
    queue = WaitingQueue(EngineConfig(max_waiting_requests=4096))
    queue.admit(make_request("keep", arrival_index=0))
    for arrival_index in range(1, MAX_STALE_HEAP_ENTRIES + 10):
        queue.admit(make_request(f"r{arrival_index}", arrival_index=arrival_index))
        queue.abort(f"r{arrival_index}")
    assert len(queue._heap) <= MAX_STALE_HEAP_ENTRIES + 1
    assert ids(queue.pop_best(10)) == ["keep"]


def test_pull_without_wait_is_answered_at_once_even_when_empty():
    queue = WaitingQueue(EngineConfig())
    queue.remember_pull(Pull(max_requests=4, wait=False))
    assert queue.answer_pull() == Pulled(requests=[], num_waiting=0)
    assert queue.answer_pull() is None


def test_pull_with_wait_is_answered_once_a_request_waits():
    queue = WaitingQueue(EngineConfig())
    queue.remember_pull(Pull(max_requests=1, wait=True))
    assert queue.answer_pull() is None
    queue.admit(make_request("a", arrival_index=0))
    queue.admit(make_request("b", arrival_index=1))
    pulled = queue.answer_pull()
    assert pulled is not None and ids(pulled.requests) == ["a"] and pulled.num_waiting == 1


# -- the actor ------------------------------------------------------------------------


class QueueHarness:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.streams = RequestStreams()
        self.queue = WaitingQueue(config)
        self.inbox, self._receive = trio.open_memory_channel[Any](16)
        self._scheduler_send, self.scheduler_inbox = trio.open_memory_channel[Any](16)

    async def start(self, nursery: trio.Nursery) -> None:
        await nursery.start(run_queue, self._receive, self._scheduler_send, self.streams,
                            self.config, self.queue)

    async def send(self, message: Any) -> None:
        await self.inbox.send(message)
        await trio.testing.wait_all_tasks_blocked()

    def next_for_scheduler(self) -> Any:
        return self.scheduler_inbox.receive_nowait()


@pytest.fixture
async def harness(nursery):
    harness = QueueHarness(EngineConfig(max_waiting_requests=2))
    await harness.start(nursery)
    return harness


async def test_actor_answers_a_waiting_pull_when_a_request_arrives(harness):
    with trio.fail_after(5):
        await harness.send(Pull(max_requests=8, wait=True))
        with pytest.raises(trio.WouldBlock):
            harness.next_for_scheduler()
        await harness.send(Admit(request=make_request("a")))
        pulled = harness.next_for_scheduler()
        assert isinstance(pulled, Pulled) and ids(pulled.requests) == ["a"]


async def test_actor_fails_the_stream_of_a_request_over_the_bound(harness):
    with trio.fail_after(5):
        stream = harness.streams.open("c")
        for arrival_index, request_id in enumerate("abc"):
            await harness.send(Admit(request=make_request(request_id,
                                                          arrival_index=arrival_index)))
        with pytest.raises(QueueFull):
            await stream.receive()
        assert harness.queue.statistics().num_waiting == 2


async def test_actor_aborts_a_waiting_request_itself(harness):
    with trio.fail_after(5):
        stream = harness.streams.open("a")
        await harness.send(Admit(request=make_request("a")))
        await harness.send(Abort(request_id="a"))
        output = await stream.receive()
        assert output.finished and output.finish_reason == "abort" and output.token_ids == []
        with pytest.raises(trio.WouldBlock):
            harness.next_for_scheduler()


async def test_actor_forwards_other_aborts_and_drops_a_requeue_in_transit(harness):
    with trio.fail_after(5):
        stream = harness.streams.open("a")
        await harness.send(Abort(request_id="a"))
        assert harness.next_for_scheduler() == Abort(request_id="a")
        # The scheduler had preempted "a" before it saw the Abort.
        await harness.send(Requeue(requests=[WaitingRequest(request=make_request("a"))]))
        await harness.send(AbortOutcome(request_id="a"))
        output = await stream.receive()
        assert output.finish_reason == "abort"
        assert harness.queue.statistics().num_waiting == 0
        assert not harness.queue._aborts_in_flight


async def test_actor_forwards_the_abort_of_a_preempted_request(harness, autojump_clock):
    with trio.fail_after(5):
        stream = harness.streams.open("a")
        preempted = WaitingRequest(request=make_request("a"), output_token_ids=[4],
                                   num_preemptions=1)
        await harness.send(Requeue(requests=[preempted]))
        await harness.send(Abort(request_id="a"))
        assert harness.next_for_scheduler() == Abort(request_id="a")
        assert harness.queue.statistics().num_waiting == 0
        with trio.move_on_after(1):
            await stream.receive()
            raise AssertionError("the scheduler publishes this abort, not the queue")


async def test_actor_closes_its_outbox_when_its_inbox_ends(harness):
    with trio.fail_after(5):
        await harness.inbox.aclose()
        with pytest.raises(trio.EndOfChannel):
            await harness.scheduler_inbox.receive()
