"""`trio-llm serve` whose engine core steps as fast as a GPU: the served layout's
HTTP side under a GPU's load, on a machine without one.

    OMP_NUM_THREADS=1 STEP_MS=2 python benchmarks/fast_core_serve.py serve --model tiny \\
        --port 8723 --api-server-count 4
    trio-llm bench serve --port 8723 --num-prompts 1000 --random-input-len 128 \\
        --random-output-len 128 --max-concurrency 256 --num-client-processes 8

The model is loaded for its sizes only; each step sleeps ``STEP_MS`` milliseconds
(default 2) and samples token ``TOKEN_ID`` (default 300, a token the tiny model's
tokenizer turns into text) for every request. Steps go through the launch/collect
interface of the CUDA executor (the result is ready ``STEP_MS`` after the launch,
or after the step launched before it, as on a device that runs one step at a time;
waited for in a worker thread), unless ``PIPELINED=0``. Every other argument is
`trio-llm`'s; the engine-core and API-server processes run this script too.

``kill -USR1 <pid>`` writes every trio task's stack (and, in the engine core, the
scheduler's and the queue's state) to ``/tmp/trio-llm-tasks-<pid>.txt``: what
`py-spy dump` cannot show when a process sits idle in epoll. This is how the
served layout's stall was found (docs/performance.md, (g)).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import trio

import trio_llm.actors.scheduler as scheduler_module
import trio_llm.actors.supervisor as supervisor_module
import trio_llm.api.engine as engine_module
import trio_llm.api.processes as processes
from trio_llm.actors.messages import ScheduledBatch, StepResult

TOKEN_ID = int(os.environ.get("TOKEN_ID", "300"))
STEP_SECONDS = float(os.environ.get("STEP_MS", "2")) / 1000
IS_PIPELINED = os.environ.get("PIPELINED", "1") != "0"


class PendingStep:
    """A launched step: done ``STEP_SECONDS`` after the device is free for it (steps
    run one at a time, in launch order, as on a GPU's stream)."""

    device_free_at = 0.0

    def __init__(self, result: StepResult) -> None:
        self.result = result
        self.done = threading.Event()
        now = time.monotonic()
        done_at = max(now, PendingStep.device_free_at) + STEP_SECONDS
        PendingStep.device_free_at = done_at
        threading.Timer(done_at - now, self.done.set).start()

    def is_ready(self) -> bool:
        return self.done.is_set()

    def wait(self) -> None:
        self.done.wait()


class FastExecutor:
    """The loaded model's sizes, a step of ``STEP_SECONDS``, token ``TOKEN_ID``."""

    def __init__(self, model: Any) -> None:
        self.model_path = model.model_path
        self.num_kv_blocks = model.num_kv_blocks
        self.max_model_len = model.max_model_len
        self.vocab_size = model.vocab_size

    def execute(self, batch: ScheduledBatch) -> StepResult:
        time.sleep(STEP_SECONDS)
        return sampled(batch)


class FastPipelinedExecutor(FastExecutor):
    def launch(self, batch: ScheduledBatch) -> PendingStep:
        return PendingStep(sampled(batch))

    def supply_bitmasks(self, pending: PendingStep, token_bitmasks: list[bytes]) -> None:
        raise AssertionError("the fast core serves no constrained rows")

    def collect(self, pending: PendingStep) -> StepResult:
        pending.wait()
        return pending.result


def sampled(batch: ScheduledBatch) -> StepResult:
    request_ids = [request.request_id for request in batch.requests if request.sample]
    return StepResult(step_id=batch.step_id, request_ids=request_ids,
                      sampled_token_ids=[TOKEN_ID] * len(request_ids))


def install() -> None:
    real_create = engine_module.create_executor
    kind = FastPipelinedExecutor if IS_PIPELINED else FastExecutor

    def create(config: Any) -> Any:
        return kind(real_create(config))

    engine_module.create_executor = create  # what created_executor calls
    real_child_command = processes._child_command

    def child_command(role: str, config: Any) -> list[str]:
        # [python, -m, trio_llm.api.processes, role, ...] -> this script, role, ...
        return [sys.executable, __file__, *real_child_command(role, config)[3:]]

    processes._child_command = child_command
    remember_policies()
    signal.signal(signal.SIGUSR1, write_tasks)


POLICIES: dict[str, Any] = {}


def remember_policies() -> None:
    for name, cls in (("scheduler", scheduler_module.Scheduler),
                      ("queue", supervisor_module.WaitingQueue)):
        original = cls.__init__

        def init(self: Any, *args: Any, _original: Any = original, _name: str = name,
                 **kwargs: Any) -> None:
            _original(self, *args, **kwargs)
            POLICIES[_name] = self

        cls.__init__ = init  # type: ignore[method-assign]


def coroutine_frames(coroutine: Any) -> list[str]:
    lines = []
    while coroutine is not None:
        frame = (getattr(coroutine, "cr_frame", None) or getattr(coroutine, "ag_frame", None)
                 or getattr(coroutine, "gi_frame", None))
        if frame is not None:
            lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
        coroutine = (getattr(coroutine, "cr_await", None) or getattr(coroutine, "ag_await", None)
                     or getattr(coroutine, "gi_yieldfrom", None))
    return lines


def write_tasks(signal_number: int, frame: FrameType | None) -> None:
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        lines.append("  " * depth + task.name)
        lines.extend("  " * depth + "  | " + line for line in coroutine_frames(task.coro))
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child, depth + 1)

    walk(trio.lowlevel.current_root_task(), 0)
    if (scheduler := POLICIES.get("scheduler")) is not None:
        lines.append(f"scheduler: {scheduler.statistics()}, {scheduler.num_in_flight} steps "
                     f"in flight")
    if (queue := POLICIES.get("queue")) is not None:
        lines.append(f"queue: {len(queue)} waiting, outstanding pull {queue._pending_pull}")
    with open(f"/tmp/trio-llm-tasks-{os.getpid()}.txt", "w") as out:
        out.write("\n".join(lines) + "\n")


def main() -> int:
    install()
    if sys.argv[1:2] and sys.argv[1] in ("core", "api-server"):
        return processes.main(sys.argv[1:])
    from trio_llm.api.cli import main as cli_main

    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
