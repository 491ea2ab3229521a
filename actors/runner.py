"""The runner actor: executes each ScheduledBatch exactly, in order.

It never decides anything: the scheduler chose the batch. On the CPU the model
runs in a worker thread so the trio thread stays free for the other actors;
the scheduler may already have sent the next batch (depth 2), which waits in
the inbox until this one is done.
"""

from __future__ import annotations

from typing import Protocol

import trio

from trio_llm.actors.messages import ScheduledBatch, SchedulerInbox, StepResult


class Executor(Protocol):
    """What the runner drives: trio_llm.gpu.executor.ModelExecutor, or a test double."""

    def execute(self, batch: ScheduledBatch) -> StepResult: ...


async def run_runner(
    inbox: trio.MemoryReceiveChannel[ScheduledBatch],
    scheduler_outbox: trio.MemorySendChannel[SchedulerInbox],
    executor: Executor,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Consume ScheduledBatch, emit one StepResult each, in order.

    An exception from the executor ends the actor, and with it the engine.
    """
    task_status.started()
    async with scheduler_outbox:
        async for batch in inbox:
            result = await trio.to_thread.run_sync(executor.execute, batch)
            await scheduler_outbox.send(result)
