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

Constraints compile here (structured outputs), once per engine whatever the
process layout: a request whose grammar is not compiled waits here, counted
in the bound, but is not handed to the scheduler until it is (``run_queue``
compiles it in a worker thread, ``CompileLanes``). The scheduler never waits on
a compile, and requests behind it are pulled meanwhile. A constraint that does
not compile fails its requests with a RequestRejected naming the problem.

Seat shares: a Pull says how many more requests of each group (the choices of
one HTTP request) may start; ``pop_best`` passes over the rest, so one
request's children never fill the seats others wait for.
"""

from __future__ import annotations

import heapq
from collections import Counter

import msgspec
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.constraint_cost import check_constraint, constraint_limits
from trio_llm.actors.errors import QueueFull, RequestRejected
from trio_llm.actors.grammar import GrammarError, Grammars, constraint_key
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
    StructuredOutputsParams,
    WaitingRequest,
)
from trio_llm.actors.streams import OutputSink

# Rebuild the heap once it holds this many more stale entries (aborted
# requests) than live ones, so aborts cannot grow it without bound.
MAX_STALE_HEAP_ENTRIES = 1024


class QueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the waiting set (``num_compiling``: of them, those whose
    constraint is still compiling)."""

    num_waiting: int
    num_compiling: int = 0


class WaitingQueue:
    """The waiting set, ordered best first, and the queue's bookkeeping.

    Policy "priority" orders by (priority, arrival_index), lower first;
    "fcfs" by arrival_index. Preempted requests keep their arrival_index, so
    they go back ahead of requests that arrived after them. The bound
    ``max_waiting_requests`` applies to new requests only: a request coming
    back from the scheduler always gets in.
    """

    def __init__(self, config: EngineConfig, grammars: Grammars | None = None) -> None:
        self.max_waiting_requests = config.max_waiting_requests
        self._orders_by_priority = config.scheduling_policy == "priority"
        self.grammars = grammars
        # seats the requests of one group may hold (the scheduler's rule, its count)
        self.max_group_seats = config.max_group_seats
        # Heap entries are (priority or 0, arrival_index, request_id); an entry
        # is stale once its request left the waiting set (it is skipped on pop).
        self._heap: list[tuple[int, int, str]] = []
        self._waiting: dict[str, WaitingRequest] = {}
        # constraint key -> its constraint and the requests waiting for it to compile
        self._compiling: dict[bytes, tuple[StructuredOutputsParams, list[WaitingRequest]]] = {}
        self._to_compile: list[StructuredOutputsParams] = []
        self._compiling_ids: set[str] = set()
        self._aborts_in_flight: Counter[str] = Counter()
        self._pending_pull: Pull | None = None

    def statistics(self) -> QueueStatistics:
        return QueueStatistics(num_waiting=len(self._waiting), num_compiling=self.num_compiling)

    @property
    def num_compiling(self) -> int:
        return len(self._compiling_ids)

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

    def pop_best(self, max_requests: int, pull: Pull | None = None) -> list[WaitingRequest]:
        """Remove and return up to ``max_requests`` requests, best first, passing
        over those of a group with no seat left (``pull``'s group seats): they
        keep their place."""
        best: list[WaitingRequest] = []
        passed_over: list[tuple[int, int, str]] = []
        seats_left = dict(pull.group_seats) if pull is not None else {}
        while self._heap and len(best) < max_requests:
            entry = heapq.heappop(self._heap)
            if not self._is_live(entry):
                continue
            group_id = self._waiting[entry[2]].request.group_id
            if group_id is not None:
                seats = seats_left.get(group_id, self.max_group_seats)
                if seats <= 0:
                    passed_over.append(entry)
                    continue
                seats_left[group_id] = seats - 1
            best.append(self._waiting.pop(entry[2]))
        for entry in passed_over:
            heapq.heappush(self._heap, entry)
        return best

    def _push(self, waiting: WaitingRequest) -> None:
        request = waiting.request
        assert request.request_id not in self._waiting, f"{request.request_id!r} already waiting"
        self._waiting[request.request_id] = waiting
        constraint = request.params.structured_outputs
        if (constraint is not None and self.grammars is not None
                and not self.grammars.is_compiled(constraint)):
            self._wait_for_compile(constraint, waiting)
        else:
            self._push_ready(waiting)

    def _push_ready(self, waiting: WaitingRequest) -> None:
        request = waiting.request
        rank = request.priority if self._orders_by_priority else 0
        heapq.heappush(self._heap, (rank, request.arrival_index, request.request_id))

    # -- constraints compiling ---------------------------------------------------

    def _wait_for_compile(self, constraint: StructuredOutputsParams,
                          waiting: WaitingRequest) -> None:
        key = constraint_key(constraint)
        compiling = self._compiling.get(key)
        if compiling is None:
            compiling = self._compiling[key] = (constraint, [])
            self._to_compile.append(constraint)
        compiling[1].append(waiting)
        self._compiling_ids.add(waiting.request.request_id)

    def take_compiles(self) -> list[StructuredOutputsParams]:
        """The constraints to start compiling (each once, until ``on_compiled``)."""
        to_compile, self._to_compile = self._to_compile, []
        return to_compile

    def on_compiled(self, constraint: StructuredOutputsParams,
                    rejection: RequestRejected | None) -> tuple[list[str], list[str]]:
        """A compile ended: its requests still waiting become pullable, or (with a
        ``rejection``) leave. Returns (ids that never ran: the caller fails their
        streams with the rejection; ids preempted before: the caller forwards an
        Abort for each to the scheduler, which ends their streams)."""
        _, requests = self._compiling.pop(constraint_key(constraint))
        never_ran: list[str] = []
        preempted: list[str] = []
        for waiting in requests:
            request_id = waiting.request.request_id
            if self._waiting.get(request_id) is not waiting:
                continue  # aborted meanwhile
            self._compiling_ids.discard(request_id)
            if rejection is None:
                self._push_ready(waiting)
                continue
            del self._waiting[request_id]
            if waiting.num_preemptions == 0:
                never_ran.append(request_id)
            else:
                self._aborts_in_flight[request_id] += 1
                preempted.append(request_id)
        return never_ran, preempted

    # -- aborts -----------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """True if the request was waiting and never ran: it is removed, and
        the caller publishes its abort. Otherwise (running, travelling, or
        waiting after a preemption, then removed too) remember the abort until
        ``forget_abort``; the caller forwards the Abort to the scheduler."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            self._compiling_ids.discard(request_id)
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
        if pull is None:
            return None
        requests = self.pop_best(pull.max_requests, pull)
        if pull.wait and not requests:
            return None
        self._pending_pull = None
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

    Rejections (queue full, a constraint that does not compile) and aborts of
    waiting requests go straight to the request's stream. Constraints compile in
    worker threads beside the loop (``CompileLanes``), each result applied as it
    comes. Closes its outbox when its inbox ends or it is cancelled (compiles
    under way are abandoned: see CompileLanes).
    """
    lanes = CompileLanes(queue.grammars, config) if queue.grammars is not None else None
    task_status.started()
    async with scheduler_outbox, trio.open_nursery() as nursery:
        async def compile_then_apply(constraint: StructuredOutputsParams) -> None:
            assert lanes is not None
            rejection = await lanes.compile(constraint)
            never_ran, preempted = queue.on_compiled(constraint, rejection)
            for request_id in never_ran:
                assert rejection is not None
                streams.fail(request_id, rejection)
            for request_id in preempted:
                await scheduler_outbox.send(Abort(request_id=request_id))
            await _answer_pull(queue, scheduler_outbox)

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
            for constraint in queue.take_compiles():
                nursery.start_soon(compile_then_apply, constraint)
            await _answer_pull(queue, scheduler_outbox)
        nursery.cancel_scope.cancel()  # the engine stops: nobody waits for a compile


async def _answer_pull(queue: WaitingQueue,
                       scheduler_outbox: trio.MemorySendChannel[SchedulerInbox]) -> None:
    pulled = queue.answer_pull()
    if pulled is not None:
        await scheduler_outbox.send(pulled)


# Compile lanes: a constraint the pre-check estimates at most this costly
# (actors/constraint_cost.py) compiles in the cheap lane.
CHEAP_CONSTRAINT_COST = 256


class CompileLanes:
    """Where constraints compile: worker threads (xgrammar lets the GIL go while it
    compiles), one compile at a time in each of two lanes, cheap and costly by the
    pre-check's estimate, so a cheap constraint never waits behind a costly one.

    A compile must end within ``structured_outputs_compile_timeout`` of being asked
    for (waiting for its lane included), or its requests are refused. xgrammar's
    native compile cannot be cancelled: its thread is abandoned and runs to its
    end, holding its lane (trio releases a thread's limiter only when the thread
    ends), so at most two compiles ever run however many time out, and the
    pre-check's limits bound how long one can run."""

    def __init__(self, grammars: Grammars, config: EngineConfig) -> None:
        self.grammars = grammars
        self.limits = constraint_limits(config)
        self.timeout_seconds = config.structured_outputs_compile_timeout
        self.cheap_lane = trio.CapacityLimiter(1)
        self.costly_lane = trio.CapacityLimiter(1)

    def lane_for(self, constraint: StructuredOutputsParams) -> trio.CapacityLimiter:
        try:
            cost = check_constraint(constraint, self.limits)
        except ValueError:
            cost = CHEAP_CONSTRAINT_COST + 1  # intake checked it against other limits
        return self.cheap_lane if cost <= CHEAP_CONSTRAINT_COST else self.costly_lane

    async def compile(self, constraint: StructuredOutputsParams) -> RequestRejected | None:
        """None once compiled (into the Grammars cache), else why it was refused."""
        lane = self.lane_for(constraint)
        with trio.move_on_after(self.timeout_seconds):
            try:
                await trio.to_thread.run_sync(self.grammars.compile, constraint,
                                              limiter=lane, abandon_on_cancel=True)
                return None
            except GrammarError as error:
                return RequestRejected(str(error), param="structured_outputs")
        return RequestRejected(
            f"the constraint did not compile within {self.timeout_seconds:g} s "
            "(--structured-outputs-compile-timeout)", param="structured_outputs")


def _queue_full(config: EngineConfig) -> QueueFull:
    return QueueFull(f"the waiting queue is full ({config.max_waiting_requests} requests); "
                     "retry later")
