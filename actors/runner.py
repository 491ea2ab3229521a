"""The runner actor: executes each ScheduledBatch exactly, in order.

It never decides anything: the scheduler chose the batch. On the CPU the model
runs in a worker thread so the trio thread stays free for the other actors;
the scheduler may already have sent the next batch (depth 2), which waits in
the inbox until this one is done. On CUDA (a PipelinedExecutor) the runner
launches step N+1 from the trio thread while step N computes, and only waits
for the device in a worker thread.

A batch with constrained rows whose bitmasks follow (``bitmask_follows``) is
sampled only once the StepBitmasks for it arrived, which the scheduler sends as
soon as the previous step is reconciled: the CPU runner waits for them before it
executes the batch; the pipelined runner launches the forward pass at once and
hands the bitmasks to the executor (``supply_bitmasks``), which enqueues the
sampling then.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, cast

import trio

from trio_llm.actors.config import MAX_PIPELINE_DEPTH
from trio_llm.actors.messages import (
    RunnerInbox,
    ScheduledBatch,
    SchedulerInbox,
    StepBitmasks,
    StepResult,
    needs_bitmasks,
    with_bitmasks,
)


class Executor(Protocol):
    """What the runner drives: trio_llm.gpu.executor.ModelExecutor, or a test double."""

    def execute(self, batch: ScheduledBatch) -> StepResult: ...


class LoadedExecutor(Executor, Protocol):
    """An executor with its model loaded, as the facade starts an engine over it: the
    sizes the other actors are configured with."""

    @property
    def model_path(self) -> Path: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that can have a step in flight while it launches the next
    (gpu/cuda_executor.py). ``launch`` enqueues a step and returns at once a pending
    step whose ``is_ready()`` polls and ``wait()`` blocks until ``collect`` can read
    its result without waiting."""

    def launch(self, batch: ScheduledBatch) -> Any: ...

    def supply_bitmasks(self, pending: Any, token_bitmasks: list[bytes]) -> None:
        """Enqueue the sampling of a launched step whose rows had ``bitmask_follows``."""
        ...

    def collect(self, pending: Any) -> StepResult: ...


async def run_runner(
    inbox: trio.MemoryReceiveChannel[RunnerInbox],
    scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
    executor: Executor,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume ScheduledBatch (and the StepBitmasks some wait for), emit one
    StepResult per batch, in order.

    An exception from the executor ends the actor, and with it the engine.
    """
    task_status.started()
    async with scheduler_outbox:
        if hasattr(executor, "launch"):
            await _run_pipelined(inbox, scheduler_outbox, cast(PipelinedExecutor, executor))
            return
        async for batch in inbox:
            assert isinstance(batch, ScheduledBatch), "StepBitmasks follow their batch"
            if needs_bitmasks(batch):
                batch = with_bitmasks(batch, await receive_bitmasks(inbox, batch.step_id))
            result = await trio.to_thread.run_sync(executor.execute, batch)
            await scheduler_outbox.send(result)


async def receive_bitmasks(inbox: trio.MemoryReceiveChannel[RunnerInbox],
                           step_id: int) -> list[bytes]:
    """The StepBitmasks of ``step_id``: the scheduler sends nothing else before them."""
    message = await inbox.receive()
    assert isinstance(message, StepBitmasks) and message.step_id == step_id, \
        "the bitmasks of a step come right after it"
    return message.token_bitmasks


# Steps an executor with launch/collect (gpu/cuda_executor.py) may have in flight.


async def _run_pipelined(inbox: trio.MemoryReceiveChannel[RunnerInbox],
                         scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
                         executor: PipelinedExecutor) -> None:
    """Launch each batch as soon as it arrives (while the previous step still runs on
    the device), and collect the steps in order in a second task.

    Launch and collect run on the trio thread: launching only enqueues device work, and
    a worker thread doing it would contend for the GIL with the scheduler and the
    detokenizer (every torch call releases and retakes it, and each retake can wait a
    whole switch interval behind the trio thread). Only the wait for a step's event,
    which holds no GIL, goes to a worker thread.
    """
    send_pending, receive_pending = trio.open_memory_channel[Any](MAX_PIPELINE_DEPTH)
    free_slots = trio.Semaphore(MAX_PIPELINE_DEPTH)

    async def launch_each() -> None:
        async with send_pending:
            async for batch in inbox:
                assert isinstance(batch, ScheduledBatch), "StepBitmasks follow their batch"
                await free_slots.acquire()
                pending = executor.launch(batch)
                if needs_bitmasks(batch):
                    # the forward pass runs meanwhile; step N-1 is collected meanwhile
                    executor.supply_bitmasks(pending,
                                             await receive_bitmasks(inbox, batch.step_id))
                await send_pending.send(pending)

    async def collect_each() -> None:
        async for pending in receive_pending:
            if not pending.is_ready():
                # Abandoned on cancellation: the wait touches nothing, and a step
                # that never completes (a hung device) must not hold shutdown.
                await trio.to_thread.run_sync(pending.wait, abandon_on_cancel=True)
            result = executor.collect(pending)
            free_slots.release()
            await scheduler_outbox.send(result)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(launch_each)
        nursery.start_soon(collect_each)
