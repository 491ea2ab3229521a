"""The pipelined executor: double-buffered steps on a compute stream and copy streams.

``CudaModelExecutor`` runs the same model and the same ScheduledBatch contract
as ModelExecutor, split so the runner can overlap the host with the device:

    pending = executor.launch(batch)   # enqueue and return at once
    pending.is_ready() / pending.wait()  # poll, or block a worker thread
    result = executor.collect(pending)   # StepResult, once it is done

One step, on the device:

1. the host packs the step's inputs (token ids, positions, slots, sequence
   lengths, block-table updates, sampling options) into the pinned buffers of
   one of two input slots; the copy stream uploads them;
2. the compute stream waits for that upload, gathers the tokens sampled in the
   previous step straight from device memory (``input_from_previous_step``),
   runs the model (a CUDA graph replay for decode-only steps of a captured
   batch size, eagerly otherwise) and samples;
3. a second copy stream waits for the compute and copies the sampled ids into
   pinned host memory; an event marks the step done. (Downloads have their own
   stream so that the next step's upload never queues behind them.)

A step with constrained rows whose grammar bitmasks follow (``bitmask_follows``:
they depend on the token the previous step is still sampling) is launched up to
its logits; ``supply_bitmasks`` enqueues its sampling and download once the
scheduler sent them, while the forward pass computes.

Events order the slots' reuse: a slot's device inputs are rewritten only after
the compute that read them, its pinned inputs only after their upload. torch
owns the streams; CuPy wraps them as external streams for its events (a
CuPy-owned stream destroyed before the tensors allocated on it crashes torch's
allocator).

On the CPU the same code runs with the streams and events reduced to no-ops,
which is how its bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import (
    NewRequestData,
    SamplingOptions,
    ScheduledBatch,
    ScheduledRequest,
    StepResult,
)
from trio_llm.gpu.cuda_sampler import (
    DeviceSamplingInputs,
    SamplingPlan,
    sample_on_device,
)
from trio_llm.gpu.executor import ModelExecutor, RequestState
from trio_llm.gpu.model import AttentionMetadata, CausalLM
from trio_llm.gpu.sampler import SamplingRow, bitmask_rows, raw_logprobs

logger = logging.getLogger(__name__)

GIB = 2**30
# Decode batch sizes that get a CUDA graph; a decode step runs the smallest that fits.
GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                     320, 384, 448, 512)
NUM_SLOTS = 2
# Host-side int64 segments of one step's upload, in order.
INT_SEGMENTS = ("token_ids", "positions", "slot_mapping", "context_lens", "query_start_loc",
                "table_rows", "logits_indices", "previous_token_positions", "previous_slots",
                "previous_rows",
                "update_rows", "update_columns", "update_block_ids", "top_ks", "seed_keys",
                "output_indices", "banned_rows", "banned_token_ids", "bitmask_rows",
                "bitmask_words")
FLOAT_SEGMENTS = ("temperatures", "top_ps", "min_ps")
# Segments start at multiples of this many elements (16 bytes or more). Triton compiles
# a kernel variant per pattern of 16-byte-aligned pointer arguments: views at arbitrary
# offsets would compile new variants in the middle of a run.
SEGMENT_ALIGNMENT = 4


@dataclass(frozen=True, slots=True)
class CudaExecutorOptions:
    """How the pipelined executor runs: graphs and fused kernels on CUDA only."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    use_cuda_graphs: bool = True
    use_fused_kernels: bool = True
    graph_capture_budget_seconds: float = 120.0
    # time each step's compute with device events (for profiles; costs two events a step)
    measure_device_time: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> CudaExecutorOptions:
        on_cuda = device.type == "cuda"
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   use_cuda_graphs=on_cuda and not config.enforce_eager,
                   use_fused_kernels=on_cuda)


# -- streams and events ----------------------------------------------------------------


class Event(Protocol):
    """A point in a stream's work: CuPy's event, or one that is always done (CPU)."""

    @property
    def done(self) -> bool: ...

    def synchronize(self) -> None: ...


class DoneEvent:
    """The CPU's event: work runs inline, so it is done as soon as it is recorded."""

    done = True

    def synchronize(self) -> None:
        pass


class Lane:
    """One stream: torch runs kernels on it, CuPy records and waits for events on it."""

    def __init__(self, device: torch.device) -> None:
        self.torch_stream: torch.cuda.Stream | None = None
        self._cupy_stream: Any = None
        if device.type == "cuda":
            import cupy

            self._cupy = cupy
            self.torch_stream = torch.cuda.Stream(device)
            self._cupy_stream = cupy.cuda.ExternalStream(self.torch_stream.cuda_stream,
                                                         device.index or 0)

    def context(self) -> Any:
        """Make this the current torch stream (a no-op on the CPU)."""
        return torch.cuda.stream(self.torch_stream) if self.torch_stream else nullcontext()

    def record(self, *, timing: bool = False, blocking: bool = False) -> Event:
        """``blocking``: a host thread waiting for it sleeps instead of spinning on a
        core (measured in workload (a): 9.1 -> 6.1 ms of process CPU per step)."""
        if self._cupy_stream is None:
            return DoneEvent()
        event = self._cupy.cuda.Event(block=blocking, disable_timing=not timing)
        event.record(self._cupy_stream)
        return event  # type: ignore[no-any-return]

    def elapsed_seconds(self, start: Event, end: Event) -> float:
        """Device time between two timing events, both complete."""
        if self._cupy_stream is None:
            return 0.0
        return float(self._cupy.cuda.get_elapsed_time(start, end)) / 1000.0

    def wait(self, event: Event | None) -> None:
        """Later work on this stream waits for ``event`` (without blocking the host)."""
        if event is not None and self._cupy_stream is not None and not isinstance(event,
                                                                                  DoneEvent):
            self._cupy_stream.wait_event(event)


# -- one step ----------------------------------------------------------------------------


@dataclass(slots=True)
class ExecutorStatistics:
    """Counts and times since start: host seconds in launch and collect (the control
    plane's share on this side), device compute seconds when measured."""

    num_steps: int = 0
    num_graph_steps: int = 0
    launch_seconds: float = 0.0
    collect_seconds: float = 0.0
    device_compute_seconds: float = 0.0


@dataclass(slots=True)
class HostStep:
    """One step's inputs, built on the host from a ScheduledBatch."""

    step_id: int
    ints: dict[str, list[int]] = field(default_factory=lambda: {name: [] for name in
                                                                INT_SEGMENTS})
    num_tokens: int = 0
    num_seqs: int = 0
    max_query_len: int = 0
    graph_batch_size: int | None = None
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    sampled_request_ids: list[str] = field(default_factory=list)
    # indices into sampling_rows of the rows whose bitmasks follow (supply_bitmasks)
    rows_awaiting_bitmasks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ForwardState:
    """A step launched up to its logits, whose sampling is still to be enqueued."""

    step: HostStep
    plan: SamplingPlan
    inputs: DeviceSamplingInputs
    logits: torch.Tensor
    compute_started: Event | None


@dataclass(slots=True)
class InputSlot:
    """Pinned host and device buffers for one step in flight, and the events guarding them."""

    index: int
    host_ints: torch.Tensor
    host_floats: torch.Tensor
    device_ints: torch.Tensor
    device_floats: torch.Tensor
    host_sampled: torch.Tensor
    upload_done: Event | None = None
    compute_done: Event | None = None
    download_done: Event | None = None


@dataclass(slots=True)
class PendingStep:
    """A launched step. ``wait`` blocks (call it from a worker thread)."""

    step_id: int
    request_ids: list[str]
    done: Event
    slot: InputSlot | None = None
    logits: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    num_logprobs: list[int | None] = field(default_factory=list)
    compute_started: Event | None = None
    compute_done: Event | None = None
    # set while the step waits for supply_bitmasks: its sampling is not enqueued yet
    forward: ForwardState | None = None

    def is_ready(self) -> bool:
        return bool(self.done.done)

    def wait(self) -> None:
        self.done.synchronize()


class Segments:
    """Views into a flat device buffer by segment name."""

    def __init__(self, buffer: torch.Tensor, offsets: dict[str, tuple[int, int]]) -> None:
        self._buffer = buffer
        self._offsets = offsets

    def __getitem__(self, name: str) -> torch.Tensor:
        start, length = self._offsets[name]
        return self._buffer[start:start + length]

    def length(self, name: str) -> int:
        return self._offsets[name][1]

    def prefix(self, length: int) -> torch.Tensor:
        """The first ``length`` elements, across segments."""
        return self._buffer[:length]


@dataclass(slots=True)
class GraphInputs:
    """Static device buffers that captured decode graphs read."""

    per_token: torch.Tensor  # [4, max_batch]: token ids, positions, slots, context lengths
    query_start_loc: torch.Tensor  # [max_batch + 1]: 0, 1, 2, ... (one token per sequence)
    block_tables: torch.Tensor  # [max_batch, max_blocks_per_seq] int32


@dataclass(slots=True)
class CapturedGraph:
    """A decode step's forward and logits, replayed as one graph: ``logits`` [batch, vocab]
    float32 is its output buffer."""

    graph: Any
    logits: torch.Tensor


class CudaModelExecutor(ModelExecutor):
    """ModelExecutor with pipelined launch/collect, CUDA graphs and fused Triton kernels.

    Build it with ``create(config)``; ``start(options)`` allocates its buffers and
    captures graphs (``create`` calls it).
    """

    def __init__(self, model: CausalLM, *, model_path: Path, num_kv_blocks: int,
                 block_size: int, max_model_len: int) -> None:
        super().__init__(model, model_path=model_path, num_kv_blocks=num_kv_blocks,
                         block_size=block_size, max_model_len=max_model_len)
        self.options = CudaExecutorOptions()
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._max_positions = model.rotary.max_positions
        self.graphs: dict[int, CapturedGraph] = {}
        self._started = False

    @classmethod
    def create(cls, config: EngineConfig) -> CudaModelExecutor:
        executor = super().create(config)
        assert isinstance(executor, CudaModelExecutor)
        executor.start(CudaExecutorOptions.from_config(config, executor.device))
        return executor

    def start(self, options: CudaExecutorOptions) -> None:
        """Allocate streams, slots and the block table; fuse kernels; capture graphs."""
        self.options = options
        if options.use_fused_kernels:
            from trio_llm.gpu.triton_layers import fuse_model

            fuse_model(self.model)
        self.compute = Lane(self.device)
        # Uploads and downloads get a copy stream each: on one, the next step's upload
        # would queue behind this step's download, which waits for this step's compute.
        self.copy = Lane(self.device)
        self.download = Lane(self.device)
        self.slots = [self._new_slot(index, 1024, 64, options.max_num_seqs)
                      for index in range(NUM_SLOTS)]
        # [slot, row]: the ids each slot's step sampled, where the next step reads them
        self.device_sampled = torch.zeros((NUM_SLOTS, options.max_num_seqs), dtype=torch.int64,
                                          device=self.device)
        num_table_rows = 2 * options.max_num_seqs + 8
        self.block_table = torch.zeros((num_table_rows, self.max_blocks_per_seq),
                                       dtype=torch.int32, device=self.device)
        self._free_table_rows = list(range(num_table_rows - 1, -1, -1))
        self._table_rows: dict[str, int] = {}
        # request id -> (slot index, row, launch number) of its latest sampled token
        self._sampled_on_device: dict[str, tuple[int, int, int]] = {}
        self._num_launches = 0
        self._outstanding: list[PendingStep] = []
        self.stats = ExecutorStatistics()
        self._started = True
        self._report_kv_cache()
        if options.use_fused_kernels:
            self._warm_up()
        if options.use_cuda_graphs:
            self._capture_graphs()

    # -- the split API ---------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Launch one step and wait for it (depth 1)."""
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> PendingStep:
        """Enqueue one step and return at once; at most two steps may be outstanding."""
        started = time.perf_counter()
        pending = self._launch(batch)
        self.stats.launch_seconds += time.perf_counter() - started
        return pending

    def _launch(self, batch: ScheduledBatch) -> PendingStep:
        assert self._started, "call start() (or build with create()) first"
        assert len(self._outstanding) < NUM_SLOTS, "collect a step before launching a third"
        updates = self._update_states_and_table(batch)
        step = self._plan(batch, updates)
        if step.num_tokens == 0:
            return PendingStep(step_id=batch.step_id, request_ids=[], done=DoneEvent())
        slot = self.slots[self._num_launches % NUM_SLOTS]
        pending = self._launch_on_device(step, slot)
        self.stats.num_steps += 1
        self.stats.num_graph_steps += step.graph_batch_size is not None
        self._remember_sampled(step, slot)
        self._num_launches += 1
        self._outstanding.append(pending)
        return pending

    def supply_bitmasks(self, pending: PendingStep, token_bitmasks: list[bytes]) -> None:
        """Enqueue the sampling of a step launched with rows whose bitmasks follow:
        ``token_bitmasks`` are theirs, in batch order (StepBitmasks)."""
        forward = pending.forward
        assert forward is not None, "this step is not waiting for bitmasks"
        started = time.perf_counter()
        rows = list(forward.step.sampling_rows)
        awaiting = forward.step.rows_awaiting_bitmasks
        assert len(awaiting) == len(token_bitmasks), "one bitmask per row that waits"
        for index, token_bitmask in zip(awaiting, token_bitmasks, strict=True):
            rows[index] = dataclasses.replace(rows[index], token_bitmask=token_bitmask)
        forward.plan, forward.inputs = self._with_bitmasks(forward, rows)
        self._enqueue_sampling(pending)
        self.stats.launch_seconds += time.perf_counter() - started

    def _with_bitmasks(self, forward: ForwardState, rows: list[SamplingRow]
                       ) -> tuple[SamplingPlan, DeviceSamplingInputs]:
        """The plan and device inputs of ``forward`` with every row's bitmask (those
        packed at launch and those that followed), uploaded on the compute stream."""
        indices, packed = bitmask_rows(rows)
        num_words = len(packed) // 4
        if num_words % 2:
            packed += bytes(4)
        words = np.frombuffer(packed, dtype=np.int64)
        plan = dataclasses.replace(forward.plan, bitmask_rows=indices, bitmask_words=words,
                                   num_bitmask_words=num_words)
        with self.compute.context():
            inputs = dataclasses.replace(
                forward.inputs, bitmask_rows=self._to_device(torch.tensor(indices)),
                bitmask_words=self._to_device(torch.from_numpy(words.copy())))
        return plan, inputs

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """An asynchronous upload from pinned memory (torch's pinned-memory cache keeps
        the buffer until the copy is done); a plain copy on the CPU."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def collect(self, pending: PendingStep) -> StepResult:
        """The step's StepResult; waits for it if it is not done yet."""
        if pending.slot is None:
            return StepResult(step_id=pending.step_id, request_ids=[], sampled_token_ids=[])
        pending.wait()
        started = time.perf_counter()
        result = self._collect(pending)
        self.stats.collect_seconds += time.perf_counter() - started
        return result

    def _collect(self, pending: PendingStep) -> StepResult:
        assert pending.slot is not None
        self._outstanding.remove(pending)
        if pending.compute_started is not None and pending.compute_done is not None:
            self.stats.device_compute_seconds += self.compute.elapsed_seconds(
                pending.compute_started, pending.compute_done)
        token_ids = pending.slot.host_sampled[:len(pending.request_ids)].tolist()
        for request_id, token_id in zip(pending.request_ids, token_ids, strict=True):
            state = self.requests.get(request_id)
            if state is not None:
                state.last_sampled_token_id = token_id
        logprobs = None
        if pending.logits is not None and pending.sampled is not None:
            logprobs = raw_logprobs(pending.logits, pending.sampled, pending.num_logprobs)
        return StepResult(step_id=pending.step_id, request_ids=pending.request_ids,
                          sampled_token_ids=token_ids, logprobs=logprobs)

    def drain(self) -> None:
        """Wait for the steps launched and never collected (a runner cancelled at
        shutdown) and drop them, so that another engine can drive this executor."""
        for pending in list(self._outstanding):
            self.collect(pending)

    # -- host side: states, block table, inputs ------------------------------------------

    def _update_states_and_table(self, batch: ScheduledBatch) -> list[tuple[int, int, int]]:
        """Apply the batch's finishes, registrations and new blocks; returns the block-table
        updates (row, column, block id) for the device."""
        for request_id in batch.finished_request_ids:
            self._forget(request_id)
        for new_request in batch.new_requests:
            self._forget(new_request.request_id)
            self.requests[new_request.request_id] = RequestState(sampling=new_request.sampling)
            self._table_rows[new_request.request_id] = self._take_table_row()
        updates: list[tuple[int, int, int]] = []
        for scheduled in batch.requests:
            state = self._state(scheduled.request_id)
            row = self._table_rows[scheduled.request_id]
            first_column = len(state.block_ids)
            if first_column + len(scheduled.new_block_ids) > self.max_blocks_per_seq:
                raise ValueError(f"request {scheduled.request_id!r} needs more than "
                                 f"{self.max_blocks_per_seq} blocks (max_model_len)")
            updates += [(row, first_column + offset, block_id)
                        for offset, block_id in enumerate(scheduled.new_block_ids)]
            state.block_ids.extend(scheduled.new_block_ids)
        return updates

    def _forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self._sampled_on_device.pop(request_id, None)
        row = self._table_rows.pop(request_id, None)
        if row is not None:
            self._free_table_rows.append(row)

    def _take_table_row(self) -> int:
        if not self._free_table_rows:
            self._grow_block_table()
        return self._free_table_rows.pop()

    def _grow_block_table(self) -> None:
        old = self.block_table
        with self.compute.context():
            self.block_table = torch.zeros((2 * old.shape[0], old.shape[1]), dtype=old.dtype,
                                           device=self.device)
            self.block_table[:old.shape[0]].copy_(old)
        self._free_table_rows = list(range(self.block_table.shape[0] - 1, old.shape[0] - 1, -1))

    def _plan(self, batch: ScheduledBatch, updates: list[tuple[int, int, int]]) -> HostStep:
        step = HostStep(step_id=batch.step_id)
        step.ints["query_start_loc"].append(0)
        for scheduled in batch.requests:
            self._add_request(step, scheduled)
        step.num_seqs = len(batch.requests)
        step.num_tokens = len(step.ints["token_ids"])
        if updates:
            rows, columns, block_ids = zip(*updates, strict=True)
            step.ints["update_rows"], step.ints["update_columns"] = list(rows), list(columns)
            step.ints["update_block_ids"] = list(block_ids)
        step.graph_batch_size = self._graph_batch_size(batch.requests, step)
        if step.graph_batch_size is not None:
            self._pad_for_graph(step, step.graph_batch_size)
        return step

    def _add_request(self, step: HostStep, scheduled: ScheduledRequest) -> None:
        # the hot loop of a decode step (hundreds of requests): plain lists, few lookups
        request_id = scheduled.request_id
        state = self._state(request_id)
        ints = step.ints
        token_ids = ints["token_ids"]
        start = scheduled.num_computed_tokens
        if scheduled.input_from_previous_step:
            self._add_previous_token(step, request_id, state)
            num_tokens = 1
        else:
            token_ids += scheduled.token_ids
            num_tokens = len(scheduled.token_ids)
        context_len = start + num_tokens
        self._check_capacity(request_id, state, context_len)
        step.max_query_len = max(step.max_query_len, num_tokens)
        blocks, block_size = state.block_ids, self.block_size
        if num_tokens == 1:
            ints["positions"].append(start)
            ints["slot_mapping"].append(blocks[start // block_size] * block_size
                                        + start % block_size)
        else:
            ints["positions"] += range(start, context_len)
            ints["slot_mapping"] += [blocks[position // block_size] * block_size
                                     + position % block_size
                                     for position in range(start, context_len)]
        ints["context_lens"].append(context_len)
        ints["query_start_loc"].append(len(token_ids))
        ints["table_rows"].append(self._table_rows[request_id])
        if scheduled.sample:
            ints["logits_indices"].append(len(token_ids) - 1)
            if scheduled.bitmask_follows:
                step.rows_awaiting_bitmasks.append(len(step.sampling_rows))
            step.sampling_rows.append(SamplingRow(state.sampling, scheduled.output_index,
                                                  scheduled.token_bitmask))
            step.sampled_request_ids.append(request_id)

    def _add_previous_token(self, step: HostStep, request_id: str, state: RequestState) -> None:
        """The token sampled for this request last step: from device memory while that
        step may still be running, from the host once it was collected."""
        ints = step.ints
        location = self._sampled_on_device.get(request_id)
        if location is not None and location[2] >= self._num_launches - NUM_SLOTS:
            slot_index, row, _ = location
            ints["previous_token_positions"].append(len(ints["token_ids"]))
            ints["previous_slots"].append(slot_index)
            ints["previous_rows"].append(row)
            ints["token_ids"].append(0)
        elif state.last_sampled_token_id is not None:
            ints["token_ids"].append(state.last_sampled_token_id)
        else:
            raise ValueError(f"request {request_id!r} takes its input from the previous step, "
                             f"but nothing was sampled for it")

    def _remember_sampled(self, step: HostStep, slot: InputSlot) -> None:
        for row, request_id in enumerate(step.sampled_request_ids):
            self._sampled_on_device[request_id] = (slot.index, row, self._num_launches)

    def _graph_batch_size(self, requests: list[ScheduledRequest], step: HostStep) -> int | None:
        """The captured batch size for a decode-only step where every request samples."""
        if not self.graphs or step.num_tokens != step.num_seqs:
            return None
        if len(step.sampling_rows) != step.num_seqs:
            return None
        return next((size for size in sorted(self.graphs) if size >= step.num_seqs), None)

    @staticmethod
    def _pad_for_graph(step: HostStep, batch_size: int) -> None:
        """Padding sequences: no cache write (slot -1), context 0 (attention gives zeros)."""
        ints = step.ints
        num_padding = batch_size - step.num_seqs
        ints["token_ids"] += [0] * num_padding
        ints["positions"] += [0] * num_padding
        ints["slot_mapping"] += [-1] * num_padding
        ints["context_lens"] += [0] * num_padding
        ints["table_rows"] += [0] * num_padding

    # -- device side -------------------------------------------------------------------

    def _launch_on_device(self, step: HostStep, slot: InputSlot) -> PendingStep:
        plan = SamplingPlan.from_rows(step.sampling_rows, self.vocab_size,
                                      can_fuse=self.options.use_fused_kernels)
        if slot.upload_done is not None:
            slot.upload_done.synchronize()  # its pinned inputs are free to rewrite
        int_offsets, float_offsets = self._pack(step, plan, slot)
        with self.copy.context():
            self.copy.wait(slot.compute_done)  # the device inputs were read by then
            _upload(slot.host_ints, slot.device_ints, _end(int_offsets))
            _upload(slot.host_floats, slot.device_floats, _end(float_offsets))
            slot.upload_done = self.copy.record()
        with self.compute.context(), torch.inference_mode():
            self.compute.wait(slot.upload_done)
            self.compute.wait(slot.download_done)  # device_sampled was copied out by then
            compute_started = (self.compute.record(timing=True)
                               if self.options.measure_device_time else None)
            ints = Segments(slot.device_ints, int_offsets)
            floats = Segments(slot.device_floats, float_offsets)
            logits = self._compute_logits(step, ints)
        pending = PendingStep(step_id=step.step_id, request_ids=step.sampled_request_ids,
                              done=DoneEvent(), slot=slot,
                              forward=ForwardState(step=step, plan=plan,
                                                   inputs=_sampling_inputs(ints, floats),
                                                   logits=logits,
                                                   compute_started=compute_started))
        if not step.rows_awaiting_bitmasks:
            self._enqueue_sampling(pending)
        return pending

    def _enqueue_sampling(self, pending: PendingStep) -> None:
        """Sample the step's logits on the compute stream, then download the ids."""
        forward, slot = pending.forward, pending.slot
        assert forward is not None and slot is not None
        plan, logits = forward.plan, forward.logits
        with self.compute.context(), torch.inference_mode():
            sampled = sample_on_device(logits, plan, forward.inputs)
            num_rows = len(pending.request_ids)
            self.device_sampled[slot.index, :num_rows].copy_(sampled)
            wants_logprobs = any(count is not None for count in plan.num_logprobs)
            # a graph's logits buffer is rewritten by its next replay, which may come
            # before this step is collected
            kept_logits = logits.clone() if wants_logprobs else None
            slot.compute_done = self.compute.record(
                timing=forward.compute_started is not None)
        with self.download.context():
            self.download.wait(slot.compute_done)
            slot.host_sampled[:num_rows].copy_(self.device_sampled[slot.index, :num_rows],
                                               non_blocking=True)
            slot.download_done = self.download.record(blocking=True)
        pending.done, pending.logits = slot.download_done, kept_logits
        pending.sampled = sampled if wants_logprobs else None
        pending.num_logprobs = plan.num_logprobs
        pending.compute_started, pending.compute_done = forward.compute_started, slot.compute_done
        pending.forward = None

    def _pack(self, step: HostStep, plan: SamplingPlan,
              slot: InputSlot) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
        ints = step.ints
        ints["top_ks"], ints["banned_rows"] = plan.top_ks, plan.banned_rows
        ints["seed_keys"], ints["output_indices"] = plan.seed_keys, plan.output_indices
        ints["banned_token_ids"] = plan.banned_token_ids
        ints["bitmask_rows"] = plan.bitmask_rows
        ints["bitmask_words"] = plan.bitmask_words  # type: ignore[assignment]  # an int64 array
        floats = {"temperatures": plan.temperatures, "top_ps": plan.top_ps,
                  "min_ps": plan.min_ps}
        int_offsets = _offsets({name: len(ints[name]) for name in INT_SEGMENTS})
        float_offsets = _offsets({name: len(floats[name]) for name in FLOAT_SEGMENTS})
        self._ensure_capacity(slot, _end(int_offsets), _end(float_offsets),
                              len(step.sampled_request_ids))
        _fill(slot.host_ints.numpy(), int_offsets, ints)
        _fill(slot.host_floats.numpy(), float_offsets, floats)
        return int_offsets, float_offsets

    def _compute_logits(self, step: HostStep, ints: Segments) -> torch.Tensor:
        self._apply_table_updates(ints)
        if step.graph_batch_size is not None:
            return self._replay_graph(step.graph_batch_size, ints)[:step.num_seqs]
        token_ids = ints["token_ids"]
        self._gather_previous_tokens(token_ids, ints)
        metadata = AttentionMetadata(
            slot_mapping=ints["slot_mapping"],
            block_tables=self.block_table.index_select(0, ints["table_rows"]),
            context_lens=ints["context_lens"].to(torch.int32),
            query_start_loc=ints["query_start_loc"].to(torch.int32),
        )
        if self.options.use_fused_kernels:
            self.model.max_query_len = step.max_query_len  # trims the prefill kernel's grid
        hidden = self.model(token_ids, ints["positions"], self.kv_caches, metadata)
        return self.model.compute_logits(hidden.index_select(0, ints["logits_indices"]))

    def _apply_table_updates(self, ints: Segments) -> None:
        if ints.length("update_rows"):
            self.block_table[ints["update_rows"], ints["update_columns"]] = (
                ints["update_block_ids"].to(torch.int32))

    def _gather_previous_tokens(self, token_ids: torch.Tensor, ints: Segments) -> None:
        if ints.length("previous_rows"):
            token_ids[ints["previous_token_positions"]] = self.device_sampled[
                ints["previous_slots"], ints["previous_rows"]]

    def _replay_graph(self, batch_size: int, ints: Segments) -> torch.Tensor:
        inputs = self._graph_inputs
        # token ids, positions, slots and context lengths: the first four segments, padded
        stride = _aligned(batch_size)
        inputs.per_token[:, :batch_size].copy_(
            ints.prefix(4 * stride).view(4, stride)[:, :batch_size])
        torch.index_select(self.block_table, 0, ints["table_rows"],
                           out=inputs.block_tables[:batch_size])
        self._gather_previous_tokens(inputs.per_token[0], ints)
        captured = self.graphs[batch_size]
        captured.graph.replay()
        return captured.logits

    # -- buffers -------------------------------------------------------------------------

    def _new_slot(self, index: int, num_ints: int, num_floats: int,
                  num_sampled: int) -> InputSlot:
        pin = self.device.type == "cuda"

        def host(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pin)

        def device(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=self.device)

        return InputSlot(index=index, host_ints=host(num_ints, torch.int64),
                         host_floats=host(num_floats, torch.float32),
                         device_ints=device(num_ints, torch.int64),
                         device_floats=device(num_floats, torch.float32),
                         host_sampled=host(num_sampled, torch.int64))

    def _ensure_capacity(self, slot: InputSlot, num_ints: int, num_floats: int,
                         num_sampled: int) -> None:
        """Grow this slot's buffers (rare: waits for the device first)."""
        if (num_ints <= slot.host_ints.shape[0] and num_floats <= slot.host_floats.shape[0]
                and num_sampled <= slot.host_sampled.shape[0]):
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        grown = self._new_slot(slot.index, max(num_ints, 2 * slot.host_ints.shape[0]),
                               max(num_floats, 2 * slot.host_floats.shape[0]),
                               max(num_sampled, slot.host_sampled.shape[0]))
        slot.host_ints, slot.host_floats = grown.host_ints, grown.host_floats
        slot.device_ints, slot.device_floats = grown.device_ints, grown.device_floats
        slot.host_sampled = grown.host_sampled
        if num_sampled > self.device_sampled.shape[1]:
            # sampled ids still to be read by the next step keep their (slot, row)
            device_sampled = torch.zeros((NUM_SLOTS, num_sampled), dtype=torch.int64,
                                         device=self.device)
            device_sampled[:, :self.device_sampled.shape[1]].copy_(self.device_sampled)
            self.device_sampled = device_sampled

    # -- start-up: report and graphs -----------------------------------------------------

    def _report_kv_cache(self) -> None:
        config = self.model.config
        bytes_per_token = (2 * config.num_layers * config.num_kv_heads * config.head_dim
                           * self.dtype.itemsize)
        num_tokens = self.num_kv_blocks * self.block_size
        logger.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GiB (%s)",
                    self.num_kv_blocks, self.block_size, num_tokens,
                    num_tokens * bytes_per_token / GIB, self.device)

    def _warm_up(self) -> None:
        """One eager prefill step with sampling, so that Triton compiles the eager path's
        kernels at start-up rather than during the first request. (It writes KV cache
        block 0, which holds nothing yet.)"""
        started = time.perf_counter()
        request_id = "warm-up"
        sampling = SamplingOptions(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                                   num_logprobs=None, min_tokens=0, banned_token_ids=[])
        num_tokens = min(self.block_size, self.max_model_len)
        batch = ScheduledBatch(
            step_id=-1, new_requests=[NewRequestData(request_id=request_id, sampling=sampling)],
            requests=[ScheduledRequest(request_id=request_id, token_ids=[0] * num_tokens,
                                       input_from_previous_step=False, num_computed_tokens=0,
                                       new_block_ids=[0], sample=True, output_index=0)],
            finished_request_ids=[], num_tokens=num_tokens)
        self.collect(self.launch(batch))
        self._forget(request_id)
        self.stats = ExecutorStatistics()
        logger.info("warmed up the eager path in %.1f s", time.perf_counter() - started)

    def _capture_graphs(self) -> None:
        sizes = sorted({size for size in GRAPH_BATCH_SIZES if size < self.options.max_num_seqs}
                       | {self.options.max_num_seqs}, reverse=True)
        max_batch = sizes[0]
        self._graph_inputs = self._new_graph_inputs(max_batch)
        pool = torch.cuda.graph_pool_handle()
        started = time.perf_counter()
        for batch_size in sizes:
            if time.perf_counter() - started > self.options.graph_capture_budget_seconds:
                logger.warning("CUDA graph capture stopped at its %.0f s budget; batch sizes "
                               "up to %d run eagerly", self.options.graph_capture_budget_seconds,
                               batch_size)
                break
            self.graphs[batch_size] = self._capture(batch_size, pool)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), ",".join(map(str, sorted(self.graphs))),
                    time.perf_counter() - started)

    def _new_graph_inputs(self, max_batch: int) -> GraphInputs:
        per_token = torch.zeros((4, max_batch), dtype=torch.int64, device=self.device)
        per_token[2].fill_(-1)  # slot -1: padding writes nothing
        return GraphInputs(
            per_token=per_token,
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((max_batch, self.max_blocks_per_seq), dtype=torch.int32,
                                     device=self.device))

    def _graph_forward(self, batch_size: int) -> torch.Tensor:
        inputs = self._graph_inputs
        token_ids, positions, slot_mapping, context_lens = inputs.per_token[:, :batch_size]
        metadata = AttentionMetadata(slot_mapping=slot_mapping,
                                     block_tables=inputs.block_tables[:batch_size],
                                     context_lens=context_lens,
                                     query_start_loc=inputs.query_start_loc[:batch_size + 1])
        hidden = self.model(token_ids, positions, self.kv_caches, metadata)
        return self.model.compute_logits(hidden)

    def _capture(self, batch_size: int, pool: Any) -> CapturedGraph:
        assert self.compute.torch_stream is not None
        with self.compute.context(), torch.inference_mode():
            self._graph_forward(batch_size)  # compiles the kernels outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=self.compute.torch_stream):
                logits = self._graph_forward(batch_size)
        return CapturedGraph(graph=graph, logits=logits)


# -- helpers -----------------------------------------------------------------------------


def _offsets(lengths: dict[str, int]) -> dict[str, tuple[int, int]]:
    offsets: dict[str, tuple[int, int]] = {}
    start = 0
    for name, length in lengths.items():
        offsets[name] = (start, length)
        start += _aligned(length)
    return offsets


def _aligned(length: int) -> int:
    return -(-length // SEGMENT_ALIGNMENT) * SEGMENT_ALIGNMENT


def _end(offsets: dict[str, tuple[int, int]]) -> int:
    return max((start + length for start, length in offsets.values()), default=0)


def _fill(target: np.ndarray, offsets: dict[str, tuple[int, int]],
          values: dict[str, list[Any]]) -> None:
    for name, (start, length) in offsets.items():
        if length:
            target[start:start + length] = values[name]


def _upload(host: torch.Tensor, device: torch.Tensor, length: int) -> None:
    if length:
        device[:length].copy_(host[:length], non_blocking=True)


def _sampling_inputs(ints: Segments, floats: Segments) -> DeviceSamplingInputs:
    return DeviceSamplingInputs(
        temperatures=floats["temperatures"], top_ps=floats["top_ps"], min_ps=floats["min_ps"],
        top_ks=ints["top_ks"], seed_keys=ints["seed_keys"],
        output_indices=ints["output_indices"],
        banned_rows=ints["banned_rows"], banned_token_ids=ints["banned_token_ids"],
        bitmask_rows=ints["bitmask_rows"], bitmask_words=ints["bitmask_words"])
