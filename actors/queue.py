"""The queue actor: the engine's one waiting set.

Requests wait here until the scheduler pulls them: new ones (Admit, from
intake) and those the scheduler hands back (Requeue: preempted, or pulled but
not admitted this step). The scheduler keeps no waiting list of its own.

Aborts race with requests travelling between queue and scheduler. The queue
settles them with tombstones: an Abort for a request that is not waiting is
forwarded to the scheduler and remembered; a Requeue of that request arriving
before the scheduler's AbortOutcome drops it. Channels are FIFO, so any Requeue
the scheduler sent before it saw the Abort arrives before the AbortOutcome.

Who publishes the abort: the queue, for a request that never ran; the
scheduler (through the detokenizer, which must forget the request too) for one
that ran before, even when it waits here after a preemption.
"""

from __future__ import annotations

import heapq
from collections import Counter

import msgspec
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import QueueFull
from trio_llm.actors.messages import (
    Abort,
    AbortOutcome,
    Admit,
    Pull,
    Pulled,
    QueueInbox,
    Request,
    RequestOutput,
    Requeue,
    SchedulerInbox,
    WaitingRequest,
)
from trio_llm.actors.streams import OutputSink

# Rebuild the heap once it holds this many more stale entries (aborted
# requests) than live ones, so aborts cannot grow it without bound.
MAX_STALE_HEAP_ENTRIES = 1024


class QueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the waiting set."""

    num_waiting: int


class WaitingQueue:
    """The waiting set, ordered best first, and the queue's bookkeeping.

    Policy "priority" orders by (priority, arrival_index), lower first;
    "fcfs" by arrival_index. Preempted requests keep their arrival_index, so
    they go back ahead of requests that arrived after them. The bound
    ``max_waiting_requests`` applies to new requests only: a request coming
    back from the scheduler always gets in.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.max_waiting_requests = config.max_waiting_requests
        self._orders_by_priority = config.scheduling_policy == "priority"
        # Heap entries are (priority or 0, arrival_index, request_id); an entry
        # is stale once its request left the waiting set (it is skipped on pop).
        self._heap: list[tuple[int, int, str]] = []
        self._waiting: dict[str, WaitingRequest] = {}
        self._aborts_in_flight: Counter[str] = Counter()
        self._pending_pull: Pull | None = None

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(num_waiting=len(self._waiting))

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    # -- the waiting set --------------------------------------------------------

    def admit(self, request: Request) -> bool:
        """Add a new request; False (and nothing added) when the queue is full."""
        if len(self._waiting) >= self.max_waiting_requests:
            return False
        self._push(WaitingRequest(request=request))
        return True

    def requeue(self, requests: list[WaitingRequest]) -> list[str]:
        """Take requests back from the scheduler, dropping those an Abort is in
        flight for; return the dropped ids that never ran (the queue publishes
        their abort; the scheduler already finished the others)."""
        dropped_request_ids = []
        for waiting in requests:
            request_id = waiting.request.request_id
            if request_id not in self._aborts_in_flight:
                self._push(waiting)
            elif waiting.num_preemptions == 0:
                dropped_request_ids.append(request_id)
        return dropped_request_ids

    def pop_best(self, max_requests: int) -> list[WaitingRequest]:
        """Remove and return up to ``max_requests`` requests, best first."""
        best: list[WaitingRequest] = []
        while self._heap and len(best) < max_requests:
            entry = heapq.heappop(self._heap)
            if self._is_live(entry):
                best.append(self._waiting.pop(entry[2]))
        return best

    def _push(self, waiting: WaitingRequest) -> None:
        request = waiting.request
        assert request.request_id not in self._waiting, f"{request.request_id!r} already waiting"
        self._waiting[request.request_id] = waiting
        rank = request.priority if self._orders_by_priority else 0
        heapq.heappush(self._heap, (rank, request.arrival_index, request.request_id))

    # -- aborts -----------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """True if the request was waiting and never ran: it is removed, and
        the caller publishes its abort. Otherwise (running, travelling, or
        waiting after a preemption, then removed too) remember the abort until
        ``forget_abort``; the caller forwards the Abort to the scheduler."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            self._drop_stale_entries()
            if waiting.num_preemptions == 0:
                return True
        self._aborts_in_flight[request_id] += 1
        return False

    def forget_abort(self, request_id: str) -> None:
        """The scheduler answered the forwarded Abort (AbortOutcome)."""
        self._aborts_in_flight[request_id] -= 1
        if self._aborts_in_flight[request_id] <= 0:
            del self._aborts_in_flight[request_id]

    def _drop_stale_entries(self) -> None:
        if len(self._heap) - len(self._waiting) > MAX_STALE_HEAP_ENTRIES or not self._waiting:
            self._heap = [entry for entry in self._heap if self._is_live(entry)]
            heapq.heapify(self._heap)

    def _is_live(self, entry: tuple[int, int, str]) -> bool:
        """Its request still waits, and is the one the entry was pushed for (an
        aborted request's entry stays behind; a later request may reuse the id)."""
        waiting = self._waiting.get(entry[2])
        return waiting is not None and waiting.request.arrival_index == entry[1]

    # -- pulls ------------------------------------------------------------------

    def remember_pull(self, pull: Pull) -> None:
        assert self._pending_pull is None, "the scheduler has one Pull outstanding at most"
        self._pending_pull = pull

    def answer_pull(self) -> Pulled | None:
        """The answer to the outstanding Pull if it can be given now: at once
        for ``wait=False``, once a request is waiting for ``wait=True``."""
        pull = self._pending_pull
        if pull is None or (pull.wait and not self._waiting):
            return None
        self._pending_pull = None
        requests = self.pop_best(pull.max_requests)
        return Pulled(requests=requests, num_waiting=len(self._waiting))


def abort_output(request_id: str) -> RequestOutput:
    """The last output of a request aborted before it ran again."""
    return RequestOutput(request_id=request_id, token_ids=[], text="", finished=True,
                         finish_reason="abort")


async def run_queue(
    inbox: trio.MemoryReceiveChannel[QueueInbox],
    scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
    streams: OutputSink,
    config: EngineConfig,
    queue: WaitingQueue,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume Admit, Requeue, Abort, Pull and AbortOutcome; emit Pulled
    answers and forwarded Aborts to the scheduler.

    Rejections (queue full) and aborts of waiting requests go straight to the
    request's stream. Closes its outbox when its inbox ends or it is cancelled.
    """
    task_status.started()
    async with scheduler_outbox:
        async for message in inbox:
            match message:
                case Admit(request=request):
                    if not queue.admit(request):
                        streams.fail(request.request_id, _queue_full(config))
                case Requeue(requests=requests):
                    for request_id in queue.requeue(requests):
                        streams.publish(abort_output(request_id))
                case Abort(request_id=request_id):
                    if queue.abort(request_id):
                        streams.publish(abort_output(request_id))
                    else:
                        await scheduler_outbox.send(message)
                case AbortOutcome(request_id=request_id):
                    queue.forget_abort(request_id)
                case Pull():
                    queue.remember_pull(message)
            pulled = queue.answer_pull()
            if pulled is not None:
                await scheduler_outbox.send(pulled)


def _queue_full(config: EngineConfig) -> QueueFull:
    return QueueFull(f"the waiting queue is full ({config.max_waiting_requests} requests); "
                     "retry later")
