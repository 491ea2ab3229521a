"""One engine, many fronts: what crosses between the engine core and its API servers.

In the served layout (docs/architecture.md, "Processes") the engine core runs
queue, scheduler and runner; each API server (a *front*) runs intake,
detokenizer and the request streams. Four edges of the actor graph cross:

    front -> core   Admit, Abort (intake -> queue), StopStringHit (detokenizer -> scheduler)
    core -> front   Track, TokenBatch (scheduler -> detokenizer),
                    StreamOutput, StreamFailure (queue -> request streams)

Each front has one local socket to the core, wrapped in a wire channel pair
(actors/wire.py); the supervisors split and merge the messages so every actor
keeps the inboxes it has in-process. This module holds the messages only the
wire carries and the core's routing policy (``FrontRoutes``): which front owns
each request, the global arrival order, and the requests of a front that went
away, which the core aborts.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from trio_llm.actors.errors import (
    EngineDead,
    EngineError,
    QueueFull,
    RequestRejected,
)
from trio_llm.actors.intake import derive_seed
from trio_llm.actors.messages import (
    Abort,
    Admit,
    Request,
    RequestOutput,
    StopStringHit,
    TokenBatch,
    TokenDelta,
    Track,
)
from trio_llm.actors.scheduler import SchedulerStatistics


class CoreReady(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The core's first message to each front: the engine is loaded; what intake needs."""

    front_index: int
    num_fronts: int
    model_path: str
    max_model_len: int
    num_kv_blocks: int
    vocab_size: int


class CoreFailed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The core's last message when an actor in it failed: every open request ends."""

    message: str


class StreamOutput(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Output the queue publishes to a request's stream (an abort of a waiting request)."""

    output: RequestOutput


ErrorKind = Literal["rejected", "queue_full", "dead"]


class StreamFailure(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """An error the core ends a request's stream with (queue full, id in use)."""

    request_id: str
    kind: ErrorKind
    message: str
    param: str | None = None


class StatisticsQuery(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A front asks for the engine's counters (for /metrics)."""

    query_id: int


class RestartCounters(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The front that warmed the core up is done: its requests are not traffic
    (``Scheduler.restart_counters``)."""


class StatisticsReply(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    query_id: int
    scheduler: SchedulerStatistics
    num_waiting: int


FrontToCore = Admit | Abort | StopStringHit | StatisticsQuery | RestartCounters
CoreToFront = (CoreReady | CoreFailed | Track | TokenBatch | StreamOutput | StreamFailure
               | StatisticsReply)


def stream_failure(request_id: str, error: EngineError) -> StreamFailure:
    """An engine error as it crosses the wire."""
    match error:
        case QueueFull():
            return StreamFailure(request_id=request_id, kind="queue_full", message=error.message)
        case RequestRejected():
            return StreamFailure(request_id=request_id, kind="rejected", message=error.message,
                                 param=error.param)
        case _:
            return StreamFailure(request_id=request_id, kind="dead", message=str(error))


def engine_error(failure: StreamFailure) -> EngineError:
    """The engine error a StreamFailure stands for, as the in-process engine raises it."""
    match failure.kind:
        case "queue_full":
            return QueueFull(failure.message)
        case "rejected":
            return RequestRejected(failure.message, param=failure.param)
        case _:
            return EngineDead(failure.message)


class FrontRoutes:
    """The core's routing policy: who owns each request, in what order requests arrived.

    A request belongs to the front that admitted it, from its Admit to the
    last message the core sends about it (a finished delta or stream output,
    a failure) or the detokenizer's StopStringHit. Arrival indices are
    restamped here, in the order Admits reach the core, so the queue's
    (priority, arrival) order is global across fronts; with one front the
    restamped indices equal intake's own.
    """

    def __init__(self, num_fronts: int) -> None:
        self.num_fronts = num_fronts
        self._owners: dict[str, int] = {}
        self._live = [True] * num_fronts
        self.num_arrivals = 0

    @property
    def num_live_fronts(self) -> int:
        return sum(self._live)

    @property
    def num_owned(self) -> int:
        return len(self._owners)

    def is_live(self, front_index: int) -> bool:
        return self._live[front_index]

    def owner(self, request_id: str) -> int | None:
        return self._owners.get(request_id)

    def admit(self, front_index: int, admit: Admit) -> Admit | None:
        """The Admit to hand the queue, restamped; None if the request id is in use."""
        request = admit.request
        if request.request_id in self._owners:
            return None
        self._owners[request.request_id] = front_index
        arrival_index = self.num_arrivals
        self.num_arrivals += 1
        if arrival_index == request.arrival_index:
            return admit
        return Admit(request=_restamped(request, arrival_index))

    def forget(self, request_id: str) -> None:
        self._owners.pop(request_id, None)

    def split(self, batch: TokenBatch) -> list[tuple[int, TokenBatch]]:
        """One step's deltas, by owning front (deltas of requests no front owns are
        dropped, as the detokenizer drops deltas it does not track); finished
        requests are forgotten."""
        owners = self._owners
        if self.num_fronts == 1:
            for delta in batch.deltas:
                if delta.finish_reason is not None:
                    owners.pop(delta.request_id, None)
            return [(0, batch)]
        by_front: dict[int, list[TokenDelta]] = {}
        for delta in batch.deltas:
            front_index = owners.get(delta.request_id)
            if front_index is None:
                continue
            if delta.finish_reason is not None:
                del owners[delta.request_id]
            deltas = by_front.get(front_index)
            if deltas is None:
                by_front[front_index] = [delta]
            else:
                deltas.append(delta)
        return [(front_index, TokenBatch(deltas=deltas))
                for front_index, deltas in by_front.items()]

    def end_output(self, output: RequestOutput) -> int | None:
        """The front a stream output goes to; forgets the request if it finished."""
        front_index = self._owners.get(output.request_id)
        if output.finished:
            self._owners.pop(output.request_id, None)
        return front_index

    def end_failure(self, request_id: str) -> int | None:
        """The front a stream failure goes to; the request is forgotten."""
        return self._owners.pop(request_id, None)

    def front_gone(self, front_index: int) -> list[Abort]:
        """A front went away: the Aborts that end every request it still owns."""
        self._live[front_index] = False
        request_ids = [rid for rid, owner in self._owners.items() if owner == front_index]
        return [Abort(request_id=request_id) for request_id in request_ids]


def _restamped(request: Request, arrival_index: int) -> Request:
    return msgspec.structs.replace(request, arrival_index=arrival_index)


def front_seed(engine_seed: int, front_index: int) -> int:
    """The seed front ``front_index``'s intake derives request seeds from: the
    engine's own for the first front (so one front samples exactly as the
    in-process engine does), a distinct one for each other front, so that two
    fronts never hand out the same seed."""
    if front_index == 0:
        return engine_seed
    return derive_seed(engine_seed, -1 - front_index)
