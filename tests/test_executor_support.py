"""Executors the engine tests put in place of the real one: each wraps the real
CPU executor and changes one thing (a fault, a held step, the pipelined interface,
a step that never completes). No tests here."""

from __future__ import annotations

import threading

import pytest
import trio

from trio_llm.actors.messages import ScheduledBatch, StepResult
from trio_llm.gpu.executor import ModelExecutor

# How long a held or hung step waits at most: a failing test must not leave a
# runner's thread blocked for ever (nor hang the run).
HOLD_LIMIT_SECONDS = 30.0


class FaultyExecutor:
    """The real executor, until step ``fail_at`` raises."""

    def __init__(self, inner: ModelExecutor, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def execute(self, batch: ScheduledBatch) -> StepResult:
        if batch.step_id >= self.fail_at:
            raise RuntimeError("injected device failure")
        return self.inner.execute(batch)


class HeldFirstStep:
    """The real executor, its first step held until ``release``: a test queues
    every request behind it, so how they batch never depends on thread timing."""

    def __init__(self, inner: ModelExecutor) -> None:
        self.inner = inner
        self._released = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def release(self) -> None:
        self._released.set()

    def execute(self, batch: ScheduledBatch) -> StepResult:
        assert self._released.wait(HOLD_LIMIT_SECONDS), "the first step was never released"
        return self.inner.execute(batch)


class DoneStep:
    """A launched step whose result is ready at once."""

    def __init__(self, result: StepResult) -> None:
        self.result = result

    def is_ready(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class InstantPipelinedExecutor:
    """The real executor behind the launch/collect interface of the CUDA one, each
    step done by the time it is launched: like a GPU step that is short next to
    the host's work, its result reaches the scheduler before anything else."""

    def __init__(self, inner: ModelExecutor) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def launch(self, batch: ScheduledBatch) -> DoneStep:
        return DoneStep(self.inner.execute(batch))

    def supply_bitmasks(self, pending: DoneStep, token_bitmasks: list[bytes]) -> None:
        raise AssertionError("this double runs no constrained rows (its steps are done)")

    def collect(self, pending: DoneStep) -> StepResult:
        return pending.result


class HungStep:
    """A launched step that does not complete (a hung device) until released."""

    def __init__(self, released: threading.Event) -> None:
        self._released = released

    def is_ready(self) -> bool:
        return self._released.is_set()

    def wait(self) -> None:
        self._released.wait(HOLD_LIMIT_SECONDS)


class HangingPipelinedExecutor(InstantPipelinedExecutor):
    """Pipelined, and from step ``hang_at`` on no step completes until ``release``;
    ``hung`` is set (on the trio thread) when the first such step is launched."""

    def __init__(self, inner: ModelExecutor, hang_at: int) -> None:
        super().__init__(inner)
        self.hang_at = hang_at
        self.hung = trio.Event()
        self._released = threading.Event()

    def release(self) -> None:
        self._released.set()

    def launch(self, batch: ScheduledBatch) -> DoneStep | HungStep:  # type: ignore[override]
        if batch.step_id < self.hang_at:
            return super().launch(batch)
        self.hung.set()
        return HungStep(self._released)

    def collect(self, pending: DoneStep | HungStep) -> StepResult:  # type: ignore[override]
        assert isinstance(pending, DoneStep), "a hung step is never collected"
        return pending.result


def test_the_benchmarks_timed_executor_keeps_a_pipelined_executor_pipelined() -> None:
    """The runner picks depth 2 by ``isinstance(executor, PipelinedExecutor)``; on
    Python 3.12 that check is static, so a wrapper's ``__getattr__`` does not count."""
    import inspect

    from trio_llm.actors.executors import PipelinedExecutor
    from trio_llm.api.bench import timed

    class Plain:
        model_path, num_kv_blocks, max_model_len, vocab_size, num_state_slots = None, 1, 1, 1, 0

        def execute(self, batch: ScheduledBatch) -> StepResult:
            raise AssertionError("not run")

    pipelined = timed(InstantPipelinedExecutor(Plain()))  # type: ignore[arg-type]
    plain = timed(Plain())
    assert isinstance(pipelined, PipelinedExecutor)
    assert not isinstance(plain, PipelinedExecutor)
    for name in ("launch", "supply_bitmasks", "collect"):  # what Python 3.12 reads
        inspect.getattr_static(pipelined, name)
        with pytest.raises(AttributeError):
            inspect.getattr_static(plain, name)
