"""The tensor-parallel executor: what the runner drives when the model is split.

It holds no model. It starts one worker process per rank (gpu/tp_worker.py,
torch.multiprocessing with spawn), sends every rank each ScheduledBatch (and the
StepBitmasks that follow some), and reads each step's StepResult from rank 0.
To the runner it is a pipelined executor like the CUDA one (``launch``,
``supply_bitmasks``, ``collect``): step N+1 goes out to the ranks while they
compute step N, so the scheduler, the runner and the actors are the same for any
number of ranks.

Failure and shutdown: while it waits for an answer it watches every rank's
process, so a rank that crashes or is killed ends the wait with a
TensorParallelError naming the rank and its traceback or exit code, never a hang
(a live rank may be blocked in a collective with the dead one; ``close`` kills
it). ``close`` ends the ranks' command pipes (each finishes and exits), waits
for them, and kills any that do not exit. If the engine's process dies, each
rank's lifeline ends and the rank exits at once.
"""

from __future__ import annotations

import logging
import signal
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.multiprocessing

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import ScheduledBatch, StepBitmasks, StepResult
from trio_llm.gpu.loader import resolve_device
from trio_llm.gpu.models.config import ModelLoadError
from trio_llm.gpu.tensor_parallel import check_divisible
from trio_llm.gpu.tp_worker import (
    WorkerFailed,
    WorkerReady,
    WorkerReport,
    WorkerSpec,
    run_worker,
)

logger = logging.getLogger(__name__)

# How long ``close`` waits for the ranks to exit before it kills them.
STOP_SECONDS = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or went away; the message names the rank."""


@dataclass(slots=True)
class Rank:
    """The engine's side of one worker process."""

    index: int
    process: BaseProcess
    commands: Connection
    # Only this process holds this end: when it closes (or the process dies) the rank exits.
    lifeline: Connection


@dataclass(slots=True)
class TensorParallelStep:
    """A step sent to every rank; its result is rank 0's next answer."""

    executor: TensorParallelExecutor
    step_id: int

    def is_ready(self) -> bool:
        return bool(self.executor.ready_objects(timeout=0.0))

    def wait(self) -> None:
        self.executor.ready_objects(timeout=None)


class TensorParallelExecutor:
    """Drives ``tensor_parallel_size`` worker processes; see the module docstring."""

    def __init__(self, ranks: list[Rank], store: tempfile.TemporaryDirectory[str]) -> None:
        self.ranks = ranks
        self._store = store
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerReport)
        self._closed = False
        self.model_path = Path()
        self.max_model_len = self.num_kv_blocks = self.vocab_size = 0
        self.num_state_slots = 0
        self.block_size = 0

    @classmethod
    def create(cls, config: EngineConfig) -> TensorParallelExecutor:
        """Start the ranks and wait until every one has loaded its shard."""
        from trio_llm.gpu.executor import ModelExecutor

        # Resolved here once (a built-in model is materialised before any rank looks).
        description = ModelExecutor.describe(config)
        world_size = config.tensor_parallel_size
        check_divisible(description.model_config, world_size)
        _check_devices(config, world_size)
        store = tempfile.TemporaryDirectory(prefix="trio-llm-tp-")
        spec = WorkerSpec(config=config, world_size=world_size,
                          init_method=f"file://{store.name}/rendezvous",
                          log_level=logging.getLogger().getEffectiveLevel())
        context = torch.multiprocessing.get_context("spawn")
        executor = cls([], store)
        executor.block_size = config.block_size
        try:
            for index in range(world_size):
                executor.ranks.append(_start_rank(context, index, spec))
            executor._take_ready(executor._receive())
        except BaseException:
            executor.close()
            raise
        logger.info("tensor parallelism %d: %d worker processes ready, %d KV blocks each",
                    world_size, world_size, executor.num_kv_blocks)
        return executor

    def _take_ready(self, message: WorkerReport) -> None:
        if not isinstance(message, WorkerReady):
            raise TensorParallelError(f"rank 0 sent {type(message).__name__} before WorkerReady")
        self.model_path = Path(message.model_path)
        self.max_model_len = message.max_model_len
        self.num_kv_blocks = message.num_kv_blocks
        self.num_state_slots = message.num_state_slots
        self.vocab_size = message.vocab_size

    # -- the runner's interface ------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepResult:
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> TensorParallelStep:
        """Send ``batch`` to every rank; returns at once."""
        self._broadcast(batch)
        return TensorParallelStep(self, batch.step_id)

    def supply_bitmasks(self, pending: TensorParallelStep, token_bitmasks: list[bytes]) -> None:
        self._broadcast(StepBitmasks(step_id=pending.step_id, token_bitmasks=token_bitmasks))

    def collect(self, pending: TensorParallelStep) -> StepResult:
        message = self._receive()
        if not isinstance(message, StepResult) or message.step_id != pending.step_id:
            raise TensorParallelError(f"rank 0 answered step {pending.step_id} with {message!r}")
        return message

    # -- pipes -----------------------------------------------------------------------

    def _broadcast(self, message: ScheduledBatch | StepBitmasks) -> None:
        data = self._encoder.encode(message)
        for rank in self.ranks:
            try:
                rank.commands.send_bytes(data)
            except OSError as error:
                raise self._failure() from error

    def ready_objects(self, timeout: float | None) -> list[Any]:
        """Wait up to ``timeout`` until rank 0 has answered or some rank has a report
        (a failure) or has exited; what is ready."""
        watched: list[Any] = [rank.commands for rank in self.ranks]
        watched += [rank.process.sentinel for rank in self.ranks]
        return wait(watched, timeout)

    def _receive(self) -> WorkerReport:
        """Rank 0's next answer; a TensorParallelError if any rank failed or exited."""
        ready = self.ready_objects(timeout=None)
        rank_0 = self.ranks[0].commands
        if ready != [rank_0]:
            raise self._failure()
        try:
            message = self._decoder.decode(rank_0.recv_bytes())
        except (EOFError, OSError) as error:
            raise self._failure() from error
        if isinstance(message, WorkerFailed):
            raise TensorParallelError(f"tensor-parallel rank {message.rank} failed:\n"
                                      f"{message.error}")
        return message

    def _failure(self) -> TensorParallelError:
        """The error naming the rank at fault. When one rank dies, the others fail
        soon after, in a collective with it, and report that: so the fault is the
        first rank to exit, a rank killed by a signal before one that exited, and
        a rank's own report (its traceback) says why it exited."""
        for rank in self._first_to_exit():
            report = _failure_report(rank)
            if report is not None:
                return TensorParallelError(f"tensor-parallel rank {report.rank} failed:\n"
                                           f"{report.error}")
            return TensorParallelError(f"tensor-parallel rank {rank.index} exited with "
                                       f"{_describe_exit(rank.process.exitcode)}")
        return TensorParallelError("a tensor-parallel rank stopped answering")

    def _first_to_exit(self) -> list[Rank]:
        """The ranks that have exited once one has (waiting up to STOP_SECONDS for one),
        those killed by a signal first."""
        sentinels: dict[Any, Rank] = {rank.process.sentinel: rank for rank in self.ranks}
        exited = [sentinels[sentinel] for sentinel in wait(list(sentinels), STOP_SECONDS)]
        for rank in exited:
            # the sentinel closes as the process exits, a moment before it can be reaped
            rank.process.join(timeout=1.0)
        return sorted(exited, key=lambda rank: (rank.process.exitcode or 0) >= 0)

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Stop every rank: end its commands, wait for it, kill it if it does not exit."""
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            rank.commands.close()
        for rank in self.ranks:
            rank.process.join(timeout=STOP_SECONDS)
            if rank.process.exitcode is None:
                logger.warning("tensor-parallel rank %d did not stop: killed", rank.index)
                rank.process.kill()
                rank.process.join()
            rank.lifeline.close()
        self._store.cleanup()


def _start_rank(context: Any, index: int, spec: WorkerSpec) -> Rank:
    engine_end, worker_end = context.Pipe(duplex=True)
    lifeline_reader, lifeline_writer = context.Pipe(duplex=False)
    process = context.Process(target=run_worker, args=(index, spec, worker_end, lifeline_reader),
                              name=f"trio-llm-tp-{index}", daemon=True)
    process.start()
    # The worker holds its ends now; closing ours lets its death end our reads.
    worker_end.close()
    lifeline_reader.close()
    return Rank(index=index, process=process, commands=engine_end, lifeline=lifeline_writer)


def _failure_report(rank: Rank) -> WorkerFailed | None:
    """The WorkerFailed ``rank`` sent, if it sent one (rank 0 may have answers before it)."""
    decoder = msgspec.msgpack.Decoder(WorkerReport)
    try:
        while rank.commands.poll(0):
            message = decoder.decode(rank.commands.recv_bytes())
            if isinstance(message, WorkerFailed):
                return message
    except (EOFError, OSError, msgspec.DecodeError):
        pass
    return None


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"signal {-exitcode} ({signal.Signals(-exitcode).name})"
    return f"code {exitcode}"


def _check_devices(config: EngineConfig, world_size: int) -> None:
    if resolve_device(config.device).type != "cuda":
        return
    num_devices = torch.cuda.device_count()
    if num_devices < world_size:
        raise ModelLoadError(f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                             f"{num_devices} visible")
