"""The supervisor: wires the five actors with bounded channels and owns failure.

Channel bounds follow one rule that keeps the actor graph free of deadlock
although it has cycles (queue <-> scheduler, scheduler <-> detokenizer):
every message *towards the scheduler* fits in its inbox without blocking,
because each one is bounded by the number of requests in the engine (one
forwarded Abort and one StopStringHit per request at most, one Pulled per Pull,
one StepResult per batch in flight). Every other edge applies backpressure.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.detokenizer import Detokenizer, run_detokenizer
from trio_llm.actors.errors import EngineDead
from trio_llm.actors.grammar import Grammars
from trio_llm.actors.intake import Intake, run_intake
from trio_llm.actors.messages import IntakeInbox
from trio_llm.actors.queue import WaitingQueue, run_queue
from trio_llm.actors.runner import Executor, run_runner
from trio_llm.actors.scheduler import Scheduler, SchedulerStatistics, run_scheduler
from trio_llm.actors.streams import RequestStreams
from trio_llm.actors.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

INTAKE_BUFFER = 64
QUEUE_BUFFER = 64
DETOKENIZER_BUFFER = 8
RUNNER_BUFFER = 2  # the pipeline depth at most: the scheduler never has more in flight


class EngineStatistics(SchedulerStatistics):
    """A snapshot of the engine's counters: the scheduler's, and the queue's length
    (frozen and keyword-only, as its base)."""

    num_waiting: int

    @property
    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, 0 to 1."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class EngineActors:
    """What the facade needs of a running engine: the intake's inbox, the
    policy objects (for statistics) and the engine's fate."""

    def __init__(self, intake_outbox: trio.MemorySendChannel[IntakeInbox],
                 queue: WaitingQueue, scheduler: Scheduler) -> None:
        self.intake_outbox = intake_outbox
        self.queue = queue
        self.scheduler = scheduler
        self.error: EngineDead | None = None
        self.dead = trio.Event()

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(**msgspec.structs.asdict(self.scheduler.statistics()),
                                num_waiting=self.queue.statistics().num_waiting)


async def run_supervisor(
    config: EngineConfig,
    executor: Executor,
    tokenizer: Tokenizer,
    streams: RequestStreams,
    *,
    max_model_len: int,
    num_kv_blocks: int,
    vocab_size: int,
    task_status: trio.TaskStatus[EngineActors] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the actors; report EngineActors once all are running.

    Runs until cancelled (shutdown). If an actor raises, every open request
    gets EngineDead, the engine is marked dead, and the supervisor returns:
    the facade makes the failure loud at its exit.
    """
    # one grammar cache: what intake compiles, the scheduler finds compiled
    grammars = Grammars(tokenizer, vocab_size)
    intake = Intake(config, tokenizer, max_model_len=max_model_len,
                    num_kv_tokens=num_kv_blocks * config.block_size, vocab_size=vocab_size,
                    grammars=grammars)
    queue = WaitingQueue(config)
    scheduler = Scheduler(config, num_kv_blocks, grammars)
    detokenizer = Detokenizer(tokenizer)
    scheduler_buffer = 2 * (config.max_num_seqs + config.max_waiting_requests) + 16

    intake_send, intake_receive = trio.open_memory_channel[Any](INTAKE_BUFFER)
    queue_send, queue_receive = trio.open_memory_channel[Any](QUEUE_BUFFER)
    scheduler_send, scheduler_receive = trio.open_memory_channel[Any](scheduler_buffer)
    runner_send, runner_receive = trio.open_memory_channel[Any](RUNNER_BUFFER)
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
        cause = group.exceptions[0]
        actors.error = EngineDead(f"the engine stopped: {type(cause).__name__}: {cause}")
        actors.error.__cause__ = cause
        streams.fail_all(actors.error)
        actors.dead.set()
