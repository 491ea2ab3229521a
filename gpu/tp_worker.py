"""One tensor-parallel worker process: a rank, its device, its shard of the model.

gpu/tp_executor.py starts one per rank (torch.multiprocessing, spawn) and sends
every rank the same messages, msgspec-encoded over a pipe: each ScheduledBatch,
and the StepBitmasks some batches wait for. Every rank runs the batch through its
own executor (the same ModelExecutor or CudaModelExecutor a single device uses,
over a sharded model): the layers' collectives meet inside the forward pass, and
every rank samples the same tokens from the gathered logits, so each keeps the
tokens its next step reads without any broadcast. Rank 0 alone answers: its
StepResult goes back over its pipe.

Lifetime: a rank ends when its command pipe ends (the engine closed it) and at
once, from a thread, when its lifeline ends: only the engine's process holds the
lifeline's other end, so a worker never outlives it, even while blocked in a
collective. A rank that fails reports WorkerFailed with its traceback and exits
non-zero; the engine watches every rank's process, so it never waits on a rank
that is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec
import torch
import torch.distributed as dist

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.executors import Executor, PendingStep, PipelinedExecutor, StepPipeline
from trio_llm.actors.messages import (
    ScheduledBatch,
    StepBitmasks,
    StepResult,
    needs_bitmasks,
    with_bitmasks,
)
from trio_llm.gpu.rank_executor import create_rank_executor
from trio_llm.gpu.tensor_parallel import TensorParallel

# How long a pipelined rank waits for a command before it looks at its oldest step again.
POLL_SECONDS = 50e-6
# Exit code of a rank whose engine went away (its lifeline ended).
ORPHAN_EXIT_CODE = 3


class WorkerReady(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Rank 0's first message: the model is loaded on every rank; the sizes the engine's
    actors are configured with."""

    model_path: str
    max_model_len: int
    num_kv_blocks: int
    vocab_size: int
    num_state_slots: int = 0


class WorkerFailed(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """A rank's last message when it fails: which rank, and its traceback."""

    rank: int
    error: str


WorkerCommand = ScheduledBatch | StepBitmasks
WorkerReport = WorkerReady | StepResult | WorkerFailed


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every rank is started with (pickled by spawn)."""

    config: EngineConfig
    world_size: int
    # torch.distributed rendezvous: a file store in a directory the engine owns
    init_method: str
    # the engine's root log level: a spawned process starts with logging unconfigured
    log_level: int = logging.WARNING


class CommandPipe:
    """A rank's end of its pipe to the engine: commands in, reports out."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._decoder = msgspec.msgpack.Decoder(WorkerCommand)
        self._encoder = msgspec.msgpack.Encoder()

    def receive(self) -> WorkerCommand | None:
        """The next command; None once the engine closed the pipe."""
        try:
            return self._decoder.decode(self.connection.recv_bytes())
        except (EOFError, OSError):
            return None

    def receive_bitmasks(self, step_id: int) -> list[bytes]:
        message = self.receive()
        assert isinstance(message, StepBitmasks) and message.step_id == step_id, \
            "the bitmasks of a step come right after it"
        return message.token_bitmasks

    def has_command(self, timeout: float) -> bool:
        return self.connection.poll(timeout)

    def report(self, message: WorkerReport) -> None:
        self.connection.send_bytes(self._encoder.encode(message))


def run_worker(rank: int, spec: WorkerSpec, commands: Connection, lifeline: Connection) -> None:
    """Entry point of rank ``rank`` (torch.multiprocessing.spawn's signature: the rank
    first). Loads this rank's shard, then executes every batch until the pipe ends."""
    # Ctrl-C reaches the whole process group: the engine decides when its ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s [tp-rank-{rank}] %(name)s %(message)s")
    _exit_with_engine(lifeline)
    pipe = CommandPipe(commands)
    try:
        parallel, device = join_group(rank, spec)
        executor = create_rank_executor(spec.config, parallel=parallel, device=device)
        if rank == 0:
            pipe.report(WorkerReady(model_path=str(executor.model_path),
                                    max_model_len=executor.max_model_len,
                                    num_kv_blocks=executor.num_kv_blocks,
                                    num_state_slots=executor.num_state_slots,
                                    vocab_size=executor.vocab_size))
        if isinstance(executor, PipelinedExecutor):
            serve_pipelined(executor, pipe, is_reporter=rank == 0)
        else:
            serve_in_order(executor, pipe, is_reporter=rank == 0)
    except BaseException:
        _report_failure(pipe, rank, traceback.format_exc())
        _exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    _exit(0)


def join_group(rank: int, spec: WorkerSpec) -> tuple[TensorParallel, torch.device]:
    """Join the process group: NCCL on CUDA (rank r on GPU r), gloo on the CPU."""
    on_cuda = spec.config.device == "cuda" or (spec.config.device == "auto"
                                               and torch.cuda.is_available())
    if on_cuda:
        # NVLink SHARP (NVLS) multicast is off: it needs fabric support the lent machines
        # lack, and NCCL's plain NVLink all-reduce is what tensor parallelism 2 wants.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        _share_cpu_threads(spec.world_size)
    # device_id binds the NCCL communicator to this GPU and creates it now, not at
    # the first collective (which may come inside a CUDA graph capture)
    dist.init_process_group("nccl" if on_cuda else "gloo", init_method=spec.init_method,
                            rank=rank, world_size=spec.world_size,
                            device_id=device if on_cuda else None)
    return TensorParallel(rank=rank, world_size=spec.world_size, group=dist.group.WORLD,
                          fixed_order_reduce=not on_cuda), device


def _share_cpu_threads(world_size: int) -> None:
    """Each of the ranks on the CPU gets its share of the cores the engine leaves free
    (configure_cpu_threads then keeps the lower count); ``OMP_NUM_THREADS`` wins."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    torch.set_num_threads(max(1, (num_cores - 1) // world_size))


def serve_in_order(executor: Executor, pipe: CommandPipe, *, is_reporter: bool) -> None:
    """One step at a time (the CPU executor)."""
    while (message := pipe.receive()) is not None:
        assert isinstance(message, ScheduledBatch), "StepBitmasks follow their batch"
        if needs_bitmasks(message):
            message = with_bitmasks(message, pipe.receive_bitmasks(message.step_id))
        result = executor.execute(message)
        if is_reporter:
            pipe.report(result)


def serve_pipelined(executor: PipelinedExecutor, pipe: CommandPipe, *,
                    is_reporter: bool) -> None:
    """Launch each batch as it arrives, up to MAX_PIPELINE_DEPTH in flight, and collect
    them in order (the CUDA executor: step N+1 is enqueued while step N computes), by
    the runner's rules (StepPipeline, actors/executors.py).

    A step whose rows wait for bitmasks is launched at once and sampled when its
    StepBitmasks arrive, the next message. Those bitmasks come only once the engine
    has step N's result, so step N is collected (and reported) meanwhile: waiting for
    them first would wait forever.
    """
    pipeline = StepPipeline(executor)

    def collect(pending: PendingStep) -> None:
        pending.wait()
        result = pipeline.collect(pending)
        if is_reporter:
            pipe.report(result)

    while True:
        oldest = pipeline.next_to_collect()
        if oldest is not None and (pipeline.is_full
                                   or not _command_before_ready(pipe, oldest)):
            collect(oldest)
            continue
        message = pipe.receive()
        if message is None:
            break
        if isinstance(message, StepBitmasks):
            pipeline.supply_bitmasks(message)
        else:
            pipeline.launch(message)
    while (oldest := pipeline.next_to_collect()) is not None:
        collect(oldest)


def _command_before_ready(pipe: CommandPipe, pending: PendingStep) -> bool:
    """Wait until a command arrives (True) or the step ``pending`` is done (False)."""
    while not pending.is_ready():
        if pipe.has_command(POLL_SECONDS):
            return True
    return False


def _exit_with_engine(lifeline: Connection) -> None:
    """End this process the moment the engine's end of ``lifeline`` closes."""
    def watch() -> None:
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="tp-lifeline", daemon=True).start()


def _exit(code: int) -> None:
    """End the process now: nothing is left to clean, and the interpreter's own exit
    waited seconds for the attention kernel's thread pool and gloo's threads."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report_failure(pipe: CommandPipe, rank: int, error: str) -> None:
    try:
        pipe.report(WorkerFailed(rank=rank, error=error))
    except OSError:
        pass  # the engine has gone: nobody to tell
