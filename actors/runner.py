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

import trio

from trio_llm.actors.config import MAX_PIPELINE_DEPTH
from trio_llm.actors.executors import (
    Executor,
    LoadedExecutor,
    PipelinedExecutor,
    StepPipeline,
)
from trio_llm.actors.messages import (
    RunnerInbox,
    ScheduledBatch,
    SchedulerInbox,
    StepBitmasks,
    needs_bitmasks,
    with_bitmasks,
)

__all__ = ["Executor", "LoadedExecutor", "PipelinedExecutor", "run_runner"]


async def run_runner(
    inbox: trio.MemoryReceiveChannel[RunnerInbox],
    scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
    executor: Executor | PipelinedExecutor,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume ScheduledBatch (and the StepBitmasks some wait for), emit one
    StepResult per batch, in order.

    An exception from the executor ends the actor, and with it the engine.
    """
    task_status.started()
    async with scheduler_outbox:
        if isinstance(executor, PipelinedExecutor):
            await _run_pipelined(inbox, scheduler_outbox, executor)
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


async def _run_pipelined(inbox: trio.MemoryReceiveChannel[RunnerInbox],
                         scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
                         executor: PipelinedExecutor) -> None:
    """Launch each batch as soon as it arrives (while the previous step still runs on
    the device), and collect the steps in order in a second task; the order's rules
    are StepPipeline's (actors/executors.py, shared with a tensor-parallel rank).

    Launch and collect run on the trio thread: launching only enqueues device work, and
    a worker thread doing it would contend for the GIL with the scheduler and the
    detokenizer (every torch call releases and retakes it, and each retake can wait a
    whole switch interval behind the trio thread). Only the wait for a step's event,
    which holds no GIL, goes to a worker thread.
    """
    pipeline = StepPipeline(executor)
    # one message per step that can be collected, in launch order
    send_collectable, receive_collectable = trio.open_memory_channel[None](MAX_PIPELINE_DEPTH)
    free_slots = trio.Semaphore(MAX_PIPELINE_DEPTH)

    async def launch_each() -> None:
        async with send_collectable:
            async for message in inbox:
                if isinstance(message, StepBitmasks):
                    # the forward pass runs meanwhile; step N-1 is collected meanwhile
                    pipeline.supply_bitmasks(message)
                else:
                    await free_slots.acquire()
                    pipeline.launch(message)
                    if pipeline.is_awaiting_bitmasks:
                        continue
                await send_collectable.send(None)

    async def collect_each() -> None:
        async for _ in receive_collectable:
            pending = pipeline.next_to_collect()
            assert pending is not None, "a step is collectable once launched and supplied"
            if not pending.is_ready():
                # Abandoned on cancellation: the wait touches nothing, and a step
                # that never completes (a hung device) must not hold shutdown.
                await trio.to_thread.run_sync(pending.wait, abandon_on_cancel=True)
            result = pipeline.collect(pending)
            free_slots.release()
            await scheduler_outbox.send(result)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(launch_each)
        nursery.start_soon(collect_each)
