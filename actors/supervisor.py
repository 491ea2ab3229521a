"""The supervisors: wire the actors with bounded channels and own failure.

One supervisor per process, and each is the one place that knows the layout:
``run_supervisor`` starts all five actors in one nursery (in-process);
``run_core_supervisor`` starts queue, scheduler and runner behind the wire
channels of N fronts, and ``run_front_supervisor`` starts intake and
detokenizer in front of the core's wire channel (served layout, see
actors/fronts.py). The actors are the same in both.

Channel bounds follow one rule that keeps the actor graph free of deadlock
although it has cycles (queue <-> scheduler, scheduler <-> detokenizer):
every message *towards the scheduler* fits in its inbox without blocking,
because each one is bounded by the number of requests in the engine (one
forwarded Abort per request, one StopStringHit per request each time the
detokenizer tracks it, one Pulled per Pull, one StepResult per batch in
flight). Every other edge applies backpressure.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import msgspec
import trio

from trio_llm.actors.config import MAX_PIPELINE_DEPTH, EngineConfig
from trio_llm.actors.detokenizer import Detokenizer, run_detokenizer
from trio_llm.actors.errors import EngineDead, EngineError
from trio_llm.actors.fronts import (
    CoreFailed,
    CoreReady,
    CoreToFront,
    FrontRoutes,
    FrontToCore,
    RestartCounters,
    StatisticsQuery,
    StatisticsReply,
    StreamFailure,
    StreamOutput,
    engine_error,
    front_seed,
    stream_failure,
)
from trio_llm.actors.grammar import Grammars
from trio_llm.actors.intake import Intake, run_intake
from trio_llm.actors.messages import (
    Abort,
    Admit,
    IntakeInbox,
    RequestOutput,
    StopStringHit,
    TokenBatch,
    Track,
)
from trio_llm.actors.pooling import PoolingConfig
from trio_llm.actors.queue import WaitingQueue, run_queue
from trio_llm.actors.runner import Executor, run_runner
from trio_llm.actors.scheduler import Scheduler, SchedulerStatistics, run_scheduler
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.actors.wire import WireError, WireReceiveChannel, WireSendChannel

logger = logging.getLogger(__name__)

INTAKE_BUFFER = 64
QUEUE_BUFFER = 64
DETOKENIZER_BUFFER = 8
# Telling the fronts that the core failed is best effort: bounded.
CORE_FAILED_SEND_SECONDS = 1.0


class EngineStatistics(SchedulerStatistics, frozen=True, kw_only=True):
    """A snapshot of the engine's counters: the scheduler's, and the queue's length
    (frozen and keyword-only, as its base)."""

    num_waiting: int

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class EngineActors:
    """What the facade needs of a running engine: the intake's inbox, the
    engine's counters and its fate. In-process, the counters are read from
    the policy objects."""

    def __init__(self, intake_outbox: trio.MemorySendChannel[IntakeInbox],
                 queue: WaitingQueue | None = None, scheduler: Scheduler | None = None) -> None:
        self.intake_outbox = intake_outbox
        self.queue = queue
        self.scheduler = scheduler
        self.error: EngineDead | None = None
        self.dead = trio.Event()

    def statistics(self) -> EngineStatistics:
        assert self.queue is not None and self.scheduler is not None
        return _engine_statistics(self.scheduler.statistics(),
                                  self.queue.statistics().num_waiting)

    async def fetch_statistics(self) -> EngineStatistics:
        await trio.lowlevel.checkpoint()
        return self.statistics()

    async def restart_counters(self) -> None:
        """Zero the engine's traffic totals (``Scheduler.restart_counters``)."""
        assert self.scheduler is not None
        await trio.lowlevel.checkpoint()
        self.scheduler.restart_counters()

    def fail(self, group: BaseExceptionGroup[Exception], streams: RequestStreams) -> None:
        """An actor failed: every open request gets EngineDead naming the cause."""
        cause = _first_cause(group)
        if isinstance(cause, EngineDead):
            self.error = cause
        else:
            self.error = EngineDead(f"the engine stopped: {type(cause).__name__}: {cause}")
            self.error.__cause__ = cause
        streams.fail_all(self.error)
        self.dead.set()


def _engine_statistics(scheduler: SchedulerStatistics, num_waiting: int) -> EngineStatistics:
    return EngineStatistics(**msgspec.structs.asdict(scheduler), num_waiting=num_waiting)


def num_state_slots_of(executor: Executor) -> int:
    """The slots of the executor's state cache (models with linear-attention layers),
    which the scheduler hands out; 0 for other models and executors that have none."""
    num_state_slots = getattr(executor, "num_state_slots", 0)
    assert isinstance(num_state_slots, int)
    return num_state_slots


def _first_cause(group: BaseExceptionGroup[Exception]) -> Exception:
    cause: BaseException = group
    while isinstance(cause, BaseExceptionGroup):
        cause = cause.exceptions[0]
    assert isinstance(cause, Exception)
    return cause


async def run_supervisor(
    config: EngineConfig,
    executor: Executor,
    tokenizer: Tokenizer,
    streams: RequestStreams,
    *,
    max_model_len: int,
    num_kv_blocks: int,
    vocab_size: int,
    pooling: PoolingConfig | None = None,
    task_status: trio.TaskStatus[EngineActors] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The in-process layout: start the five actors; report EngineActors once all run.

    Runs until cancelled (shutdown). If an actor raises, every open request
    gets EngineDead, the engine is marked dead, and the supervisor returns:
    the facade makes the failure loud at its exit.
    """
    # one grammar cache: what the queue compiles, the scheduler finds compiled
    grammars = engine_grammars(config, tokenizer, vocab_size)
    intake = Intake(config, tokenizer, max_model_len=max_model_len,
                    num_kv_tokens=num_kv_blocks * config.block_size, vocab_size=vocab_size,
                    pooling=pooling)
    queue = WaitingQueue(config, grammars)
    scheduler = Scheduler(config, num_kv_blocks, grammars,
                          num_state_slots=num_state_slots_of(executor))
    detokenizer = Detokenizer(tokenizer)

    intake_send, intake_receive = trio.open_memory_channel[Any](INTAKE_BUFFER)
    queue_send, queue_receive = trio.open_memory_channel[Any](QUEUE_BUFFER)
    scheduler_send, scheduler_receive = trio.open_memory_channel[Any](_scheduler_buffer(config))
    runner_send, runner_receive = trio.open_memory_channel[Any](MAX_PIPELINE_DEPTH)
    detokenizer_send, detokenizer_receive = trio.open_memory_channel[Any](DETOKENIZER_BUFFER)
    actors = EngineActors(intake_send, queue, scheduler)
    started = False
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_runner, runner_receive, scheduler_send.clone(), executor)
            await nursery.start(run_detokenizer, detokenizer_receive, scheduler_send.clone(),
                                streams, detokenizer)
            await nursery.start(run_scheduler, scheduler_receive, queue_send.clone(), runner_send,
                                detokenizer_send, scheduler)
            await nursery.start(run_queue, queue_receive, scheduler_send, streams, config, queue)
            await nursery.start(run_intake, intake_receive, queue_send, streams, intake)
            task_status.started(actors)
            started = True
    except* Exception as group:
        if not started:
            raise
        logger.exception("engine actor failed; failing every open request", exc_info=group)
        actors.fail(group, streams)


def engine_grammars(config: EngineConfig, tokenizer: Tokenizer, vocab_size: int) -> Grammars:
    """The engine's grammar cache, bounded by ``structured_outputs_cache_mb``."""
    return Grammars(tokenizer, vocab_size, cache_bytes=config.structured_outputs_cache_mb * 2**20)


def _scheduler_buffer(config: EngineConfig) -> int:
    """Room for every message that may be in flight towards the scheduler (see
    the module docstring): a send into its inbox never blocks."""
    return 2 * (config.max_num_seqs + config.max_waiting_requests) + 16


# -- the served layout: the engine core ------------------------------------------------


class _FrontLinks:
    """The core's side of every front's wire channel: sends that a front gone
    away cannot block or break, and the aborts of its requests."""

    def __init__(self, config: EngineConfig, wires: list[WireSendChannel[CoreToFront]],
                 routes: FrontRoutes, queue_outbox: trio.MemorySendChannel[Any]) -> None:
        self.routes = routes
        self._wires = wires
        self._queue_outbox = queue_outbox
        self.all_gone = trio.Event()
        # Stream outputs and statistics replies are published without waiting (the
        # queue never blocks on a caller); each front's are pumped to its wire.
        self.stream_outboxes: list[trio.MemorySendChannel[CoreToFront]] = []
        self.stream_inboxes: list[trio.MemoryReceiveChannel[CoreToFront]] = []
        for _ in wires:
            send, receive = trio.open_memory_channel[CoreToFront](_scheduler_buffer(config))
            self.stream_outboxes.append(send)
            self.stream_inboxes.append(receive)

    async def send(self, front_index: int, message: CoreToFront) -> None:
        if self.routes.is_live(front_index):
            await self.send_last(front_index, message)

    async def send_last(self, front_index: int, message: CoreToFront) -> None:
        """Send even to a front marked gone (the core's own failure, which the
        front must learn however the core's nursery ended)."""
        try:
            await self._wires[front_index].send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the front died: its reader sees the end and aborts its requests

    def send_nowait(self, front_index: int, message: CoreToFront) -> None:
        if not self.routes.is_live(front_index):
            return
        try:
            self.stream_outboxes[front_index].send_nowait(message)
        except trio.WouldBlock:
            # A front that reads none of thousands of messages is hung: cut it
            # off; its requests are aborted once its reader sees the socket end.
            logger.error("API server %d reads nothing; disconnecting it", front_index)
            self.disconnect(front_index)

    def disconnect(self, front_index: int) -> None:
        """Cut a front off: both sides see its socket end (and the core aborts
        its requests when its reader does)."""
        self._wires[front_index].disconnect()

    async def pump(self, front_index: int) -> None:
        async for message in self.stream_inboxes[front_index]:
            await self.send(front_index, message)

    async def front_gone(self, front_index: int) -> None:
        if not self.routes.is_live(front_index):
            return
        aborts = self.routes.front_gone(front_index)
        if aborts:
            logger.warning("API server %d went away: aborting its %d requests", front_index,
                           len(aborts))
        for abort in aborts:
            await self._queue_outbox.send(abort)
        if self.routes.num_live_fronts == 0:
            self.all_gone.set()


class RemoteStreams:
    """The request streams as the core's queue sees them: each output or failure
    goes over the wire to the front that owns the request. Never blocks."""

    def __init__(self, links: _FrontLinks) -> None:
        self._links = links
        self._routes = links.routes

    def publish(self, output: RequestOutput) -> None:
        front_index = self._routes.end_output(output)
        if front_index is not None:
            self._links.send_nowait(front_index, StreamOutput(output=output))

    def fail(self, request_id: str, error: EngineError) -> None:
        front_index = self._routes.end_failure(request_id)
        if front_index is not None:
            self._links.send_nowait(front_index, stream_failure(request_id, error))


async def run_core_supervisor(
    config: EngineConfig,
    executor: Executor,
    fronts: list[tuple[WireSendChannel[CoreToFront], WireReceiveChannel[FrontToCore]]],
    *,
    model_path: str,
    max_model_len: int,
    num_kv_blocks: int,
    vocab_size: int,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The served layout's engine core: queue, scheduler and runner behind the
    wire channels of every front (API server).

    Greets each front with CoreReady, then routes: Admit and Abort into the
    queue (Admits restamped in global arrival order), StopStringHit into the
    scheduler, Track and TokenBatch to the owning front. A front that goes
    away has its requests aborted; the others go on. Returns once every front
    has gone. If an actor fails, every front is told (CoreFailed) and
    EngineDead is raised.
    """
    # The one grammar cache: the core's queue compiles each constraint (the fronts
    # only check its shape), the scheduler builds the masks from it.
    grammars = engine_grammars(config, Tokenizer.from_dir(config.tokenizer or model_path),
                               vocab_size)
    queue = WaitingQueue(config, grammars)
    scheduler = Scheduler(config, num_kv_blocks, grammars,
                          num_state_slots=num_state_slots_of(executor))
    routes = FrontRoutes(len(fronts))

    queue_send, queue_receive = trio.open_memory_channel[Any](QUEUE_BUFFER)
    scheduler_send, scheduler_receive = trio.open_memory_channel[Any](_scheduler_buffer(config))
    runner_send, runner_receive = trio.open_memory_channel[Any](MAX_PIPELINE_DEPTH)
    detokenizer_send, detokenizer_receive = trio.open_memory_channel[Any](DETOKENIZER_BUFFER)
    links = _FrontLinks(config, [send for send, _ in fronts], routes, queue_send.clone())
    streams = RemoteStreams(links)
    for front_index in range(len(fronts)):
        # A front that died while the model loaded is found out by its reader.
        await links.send(front_index, CoreReady(
            front_index=front_index, num_fronts=len(fronts), model_path=model_path,
            max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, vocab_size=vocab_size))
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_runner, runner_receive, scheduler_send.clone(), executor)
            await nursery.start(run_scheduler, scheduler_receive, queue_send.clone(), runner_send,
                                detokenizer_send, scheduler)
            await nursery.start(run_queue, queue_receive, scheduler_send.clone(), streams, config,
                                queue)
            nursery.start_soon(_route_to_fronts, detokenizer_receive, links)
            for front_index, (_, wire) in enumerate(fronts):
                nursery.start_soon(links.pump, front_index)
                nursery.start_soon(_read_front, front_index, wire, links, queue_send.clone(),
                                   scheduler_send.clone(), queue, scheduler)
            task_status.started()
            await links.all_gone.wait()
            logger.info("every API server has gone: the engine core stops")
            nursery.cancel_scope.cancel()
    except* Exception as group:
        logger.exception("engine core actor failed; telling every API server", exc_info=group)
        cause = _first_cause(group)
        message = f"the engine stopped: {type(cause).__name__}: {cause}"
        with trio.move_on_after(CORE_FAILED_SEND_SECONDS, shield=True):
            for front_index in range(len(fronts)):
                await links.send_last(front_index, CoreFailed(message=message))
        raise EngineDead(message) from cause


async def _route_to_fronts(inbox: trio.MemoryReceiveChannel[Any], links: _FrontLinks) -> None:
    """The scheduler's detokenizer edge: each Track, and each front's share of a
    TokenBatch, to the front that owns the request."""
    routes = links.routes
    async for message in inbox:
        match message:
            case TokenBatch():
                for front_index, batch in routes.split(message):
                    await links.send(front_index, batch)
            case Track(request=request):
                owner = routes.owner(request.request_id)
                if owner is not None:
                    await links.send(owner, message)


async def _read_front(front_index: int, wire: WireReceiveChannel[FrontToCore],
                      links: _FrontLinks, queue_outbox: trio.MemorySendChannel[Any],
                      scheduler_outbox: trio.MemorySendChannel[Any], queue: WaitingQueue,
                      scheduler: Scheduler) -> None:
    """A front's messages, into the queue's and the scheduler's inboxes; the
    front's requests aborted once it has gone (its socket ended)."""
    routes = links.routes
    async with queue_outbox, scheduler_outbox:
        try:
            async for message in wire:
                match message:
                    case Admit():
                        admitted = routes.admit(front_index, message)
                        if admitted is None:
                            links.send_nowait(front_index, _id_in_use(message))
                        else:
                            await queue_outbox.send(admitted)
                    case Abort():
                        await queue_outbox.send(message)
                    case StopStringHit(request_id=request_id):
                        routes.forget(request_id)
                        await scheduler_outbox.send(message)
                    case StatisticsQuery(query_id=query_id):
                        links.send_nowait(front_index, StatisticsReply(
                            query_id=query_id, scheduler=scheduler.statistics(),
                            num_waiting=queue.statistics().num_waiting))
                    case RestartCounters():
                        scheduler.restart_counters()
        except WireError as error:
            logger.error("API server %d sent a bad frame: %s; disconnecting it", front_index,
                         error)
            links.disconnect(front_index)
    # Its socket ended (not cancelled: the core stopping is not a front going).
    await links.front_gone(front_index)


def _id_in_use(admit: Admit) -> StreamFailure:
    request_id = admit.request.request_id
    return StreamFailure(request_id=request_id, kind="rejected",
                         message=f"request id {request_id!r} is already in use",
                         param="request_id")


# -- the served layout: a front (API server) --------------------------------------------


class FrontActors(EngineActors):
    """What the facade of an API server needs: the intake's inbox, the engine's
    counters (asked of the core) and the engine's fate."""

    def __init__(self, intake_outbox: trio.MemorySendChannel[IntakeInbox],
                 core_outbox: trio.MemorySendChannel[Any], ready: CoreReady) -> None:
        super().__init__(intake_outbox)
        self.ready = ready
        self._core_outbox = core_outbox
        self._query_ids = itertools.count()
        self._replies: dict[int, StatisticsReply | None] = {}
        self._answered = trio.lowlevel.ParkingLot()

    def statistics(self) -> EngineStatistics:
        raise EngineError("the engine core runs in another process: use fetch_statistics()")

    async def fetch_statistics(self) -> EngineStatistics:
        """The core's counters, asked over the wire."""
        if self.error is not None:
            raise self.error
        query_id = next(self._query_ids)
        self._replies[query_id] = None
        try:
            await self._core_outbox.send(StatisticsQuery(query_id=query_id))
            while (reply := self._replies[query_id]) is None:
                if self.error is not None:
                    raise self.error
                await self._answered.park()
        finally:
            del self._replies[query_id]
        return _engine_statistics(reply.scheduler, reply.num_waiting)

    async def restart_counters(self) -> None:
        """Zero the core's traffic totals: sent after this front's requests, so every
        one of them was counted before."""
        if self.error is not None:
            raise self.error
        await self._core_outbox.send(RestartCounters())

    def on_reply(self, reply: StatisticsReply) -> None:
        if reply.query_id in self._replies:
            self._replies[reply.query_id] = reply
            self._answered.unpark_all()

    def fail(self, group: BaseExceptionGroup[Exception], streams: RequestStreams) -> None:
        super().fail(group, streams)
        self._answered.unpark_all()


async def run_front_supervisor(
    config: EngineConfig,
    tokenizer: Tokenizer,
    streams: RequestStreams,
    ready: CoreReady,
    core: tuple[WireSendChannel[FrontToCore], WireReceiveChannel[CoreToFront]],
    *,
    pooling: PoolingConfig | None = None,
    task_status: trio.TaskStatus[FrontActors] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The served layout's front (one API server): intake and detokenizer
    before the core's wire channel; report FrontActors once they run.

    Intake's Admit/Abort and the detokenizer's StopStringHit go to the core;
    the core's Track and TokenBatch go to the detokenizer, its stream outputs
    and failures to the request streams. Runs until cancelled. If the core
    fails or goes away (its socket ends), every open request gets EngineDead
    and the engine is marked dead, as when an actor fails in-process.
    """
    intake_config = msgspec.structs.replace(config, seed=front_seed(config.seed,
                                                                     ready.front_index))
    intake = Intake(intake_config, tokenizer, max_model_len=ready.max_model_len,
                    num_kv_tokens=ready.num_kv_blocks * config.block_size,
                    vocab_size=ready.vocab_size, pooling=pooling)
    detokenizer = Detokenizer(tokenizer)
    core_wire_send, core_wire_receive = core

    intake_send, intake_receive = trio.open_memory_channel[Any](INTAKE_BUFFER)
    core_send, core_receive = trio.open_memory_channel[Any](INTAKE_BUFFER)
    detokenizer_send, detokenizer_receive = trio.open_memory_channel[Any](DETOKENIZER_BUFFER)
    actors = FrontActors(intake_send, core_send.clone(), ready)
    started = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump_to_core, core_receive, core_wire_send)
            nursery.start_soon(_read_core, core_wire_receive, detokenizer_send, streams, actors)
            await nursery.start(run_detokenizer, detokenizer_receive, core_send.clone(),
                                streams, detokenizer)
            await nursery.start(run_intake, intake_receive, core_send, streams, intake)
            task_status.started(actors)
            started = True
    except* Exception as group:
        if not started:
            raise
        logger.error("the engine core failed or went away; failing every open request")
        actors.fail(group, streams)


async def _pump_to_core(inbox: trio.MemoryReceiveChannel[Any],
                        wire: WireSendChannel[FrontToCore]) -> None:
    """Intake's and the detokenizer's messages to the core, in order."""
    async with wire:
        async for message in inbox:
            try:
                await wire.send(message)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the core is gone: the reader reports it


async def _read_core(wire: WireReceiveChannel[CoreToFront],
                     detokenizer_outbox: trio.MemorySendChannel[Any],
                     streams: RequestStreams, actors: FrontActors) -> None:
    """The core's messages, to the detokenizer's inbox and the request streams."""
    async with detokenizer_outbox:
        try:
            async for message in wire:
                match message:
                    case TokenBatch() | Track():
                        await detokenizer_outbox.send(message)
                    case StreamOutput(output=output):
                        streams.publish(output)
                    case StreamFailure(request_id=request_id):
                        streams.fail(request_id, engine_error(message))
                    case StatisticsReply():
                        actors.on_reply(message)
                    case CoreFailed(message=reason):
                        raise EngineDead(reason)
                    case CoreReady():
                        raise WireError("a second CoreReady")
        except WireError as error:
            raise EngineDead(f"the engine core sent a bad frame: {error}") from error
    raise EngineDead("the engine core went away")
