"""What the runner drives: the executor protocols, and the order of a pipelined one's steps.

Trio-free, so that a tensor-parallel rank (gpu/tp_worker.py), which runs the
same executors without an event loop, shares it with the runner actor
(actors/runner.py): the rules of a pipelined step's order are written once,
in ``StepPipeline``, and each drives it with its own way of waiting.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from trio_llm.actors.config import MAX_PIPELINE_DEPTH
from trio_llm.actors.messages import ScheduledBatch, StepBitmasks, StepResult, needs_bitmasks


class Executor(Protocol):
    """Runs one step at a time: trio_llm.gpu.executor.ModelExecutor, or a test double."""

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
    def num_state_slots(self) -> int:
        """Slots of the state caches of a model with linear-attention layers (0 for
        others): max_num_seqs for running requests, the rest for prefix-cache snapshots."""
        ...

    @property
    def vocab_size(self) -> int: ...


class PendingStep(Protocol):
    """A launched step: ``is_ready()`` polls, ``wait()`` blocks until ``collect`` can read
    its result without waiting."""

    def is_ready(self) -> bool: ...

    def wait(self) -> None: ...


@runtime_checkable
class PipelinedExecutor(Protocol):
    """An executor that can have a step in flight while it launches the next
    (gpu/cuda_executor.py, gpu/tp_executor.py): ``launch`` enqueues a step and returns at
    once; ``collect`` reads its result. Checked with ``isinstance``."""

    def launch(self, batch: ScheduledBatch) -> Any: ...

    def supply_bitmasks(self, pending: Any, token_bitmasks: list[bytes]) -> None:
        """Enqueue the sampling of a launched step whose rows had ``bitmask_follows``."""
        ...

    def collect(self, pending: Any) -> StepResult: ...


class StepPipeline:
    """The order of a pipelined executor's steps: each batch launched as it arrives, at
    most MAX_PIPELINE_DEPTH in flight; the bitmasks of a step whose rows wait for them
    come right after it (before the next batch); steps collected oldest first, a step
    only once its bitmasks were supplied (its sampling is not enqueued before).

    Those bitmasks come only once the engine has the previous step's result, so the
    previous step must be collectable while a step waits for them: ``next_to_collect``
    offers it."""

    def __init__(self, executor: PipelinedExecutor) -> None:
        self.executor = executor
        self._in_flight: deque[Any] = deque()
        self._awaiting_bitmasks: Any = None  # the newest step, its sampling not enqueued

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def is_full(self) -> bool:
        return len(self._in_flight) >= MAX_PIPELINE_DEPTH

    @property
    def is_awaiting_bitmasks(self) -> bool:
        return self._awaiting_bitmasks is not None

    def launch(self, batch: ScheduledBatch) -> None:
        assert not self.is_full, "collect a step before launching another"
        assert self._awaiting_bitmasks is None, "a step's bitmasks come before the next step"
        pending = self.executor.launch(batch)
        self._in_flight.append(pending)
        if needs_bitmasks(batch):
            self._awaiting_bitmasks = pending

    def supply_bitmasks(self, message: StepBitmasks) -> None:
        pending = self._awaiting_bitmasks
        assert pending is not None and pending.step_id == message.step_id, \
            "the bitmasks of a step come right after it"
        self.executor.supply_bitmasks(pending, message.token_bitmasks)
        self._awaiting_bitmasks = None

    def next_to_collect(self) -> PendingStep | None:
        """The oldest step in flight, unless there is none or it waits for bitmasks."""
        if not self._in_flight or self._in_flight[0] is self._awaiting_bitmasks:
            return None
        return self._in_flight[0]

    def collect(self, pending: PendingStep) -> StepResult:
        """``pending``'s result (from ``next_to_collect``; waits if it is not done)."""
        assert self._in_flight and pending is self._in_flight[0], "steps are collected in order"
        self._in_flight.popleft()
        return self.executor.collect(pending)
