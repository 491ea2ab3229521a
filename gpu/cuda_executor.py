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
   runs the model (a CUDA graph replay, gpu/cuda_graphs.py: decode-only steps by
   batch size, every other step by token count; eagerly only beyond the largest
   captured size) and samples;
3. a second copy stream waits for the compute and copies the sampled ids into
   pinned host memory; an event marks the step done. (Downloads have their own
   stream so that the next step's upload never queues behind them.)

Events order the slots' reuse: a slot's device inputs are rewritten only after
the compute that read them, its pinned inputs only after their upload
(gpu/cuda_streams.py). The upload's layout and a graph step's padding are in
gpu/step_packing.py. This module launches and collects; a step's planning on the
host (each request's block-table row, where its last token is) is
gpu/cuda_plan.py's, the start-up (warm-up, graph capture) gpu/cuda_startup.py's.

A step with constrained rows whose grammar bitmasks follow (``bitmask_follows``:
they depend on the token the previous step is still sampling) is launched up to
its logits; ``supply_bitmasks`` enqueues its sampling and download once the
scheduler sent them, while the forward pass computes.

On the CPU the same code runs with the streams and events reduced to no-ops,
which is how its bookkeeping is tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import (
    ScheduledBatch,
    StepResult,
)
from trio_llm.gpu import cuda_startup
from trio_llm.gpu.cuda_graphs import (
    DecodeGraphs,
    VarlenGraphs,
    with_previous_tokens,
)
from trio_llm.gpu.cuda_plan import NUM_SLOTS, StepPlanner
from trio_llm.gpu.cuda_sampler import (
    DeviceSamplingInputs,
    SamplingPlan,
    record_on_device,
    sample_on_device,
)
from trio_llm.gpu.cuda_streams import DoneEvent, Event, Lane
from trio_llm.gpu.executor import (
    ExecutorCore,
    copy_state_slots,
    load_executor_model,
)
from trio_llm.gpu.models.base import CausalLM
from trio_llm.gpu.models.cuda_hybrid import CudaStepMetadata
from trio_llm.gpu.pooling import pooled_output, pooled_vectors
from trio_llm.gpu.sampler import (
    PromptLogprobRows,
    prompt_logprobs,
    raw_logprobs,
)
from trio_llm.gpu.step_packing import (
    FLOAT_SEGMENTS,
    INT_SEGMENTS,
    HostStep,
    InputSlot,
    Segments,
    fill,
    layout,
    new_slot,
    pad_decode_sequences,
    pad_varlen_sequences,
    upload_capacity,
)
from trio_llm.gpu.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class CudaExecutorOptions:
    """How the pipelined executor runs: graphs and fused kernels on CUDA only."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    use_cuda_graphs: bool = True
    use_fused_kernels: bool = True
    graph_capture_budget_seconds: float = 120.0
    # graph capture stops (and logs it) once the graphs' memory pool holds this much
    graph_memory_budget_gib: float = 8.0
    # time each step's compute with device events (for profiles; costs two events a step)
    measure_device_time: bool = False

    @classmethod
    def from_config(cls, config: EngineConfig, device: torch.device) -> CudaExecutorOptions:
        on_cuda = device.type == "cuda"
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   use_cuda_graphs=on_cuda and not config.enforce_eager,
                   use_fused_kernels=on_cuda)


# -- one step ----------------------------------------------------------------------------


STEP_KINDS = ("decode", "mixed", "prefill")


@dataclass(slots=True)
class ExecutorStatistics:
    """Counts and times since start: host seconds in launch and collect (the control
    plane's share on this side), device compute seconds when measured; and per kind
    of step (decode-only, mixed, prefill-only) its steps, graph replays and launch time."""

    num_steps: int = 0
    num_graph_steps: int = 0
    launch_seconds: float = 0.0
    collect_seconds: float = 0.0
    device_compute_seconds: float = 0.0
    num_steps_by_kind: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    num_graph_steps_by_kind: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    launch_seconds_by_kind: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    # the share of launch_seconds spent waiting for the device (a slot's previous upload,
    # which waits for the compute two steps back): the host's own work is the rest
    launch_wait_seconds_by_kind: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    # the shares of launch_seconds in planning (states, inputs, a graph's padding) and in
    # packing (the sampling plan, filling the pinned upload); the rest is the calls that
    # enqueue device work (copies, graph inputs, replay, sampling, download, events)
    plan_seconds_by_kind: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    pack_seconds_by_kind: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))


@dataclass(slots=True)
class ForwardState:
    """A step launched up to its logits, whose sampling is still to be enqueued."""

    step: HostStep
    plan: SamplingPlan
    inputs: DeviceSamplingInputs
    logits: torch.Tensor
    compute_started: Event | None


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
    # the positions whose prompt logprobs are asked, and their hidden states
    prompt_logprob_rows: PromptLogprobRows | None = None
    prompt_hidden: torch.Tensor | None = None
    # (request id, vector on the device) of the embedding requests it finishes
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def is_ready(self) -> bool:
        return bool(self.done.done)

    def wait(self) -> None:
        self.done.synchronize()


class CudaModelExecutor(ExecutorCore):
    """ModelExecutor's contract with pipelined launch/collect, CUDA graphs and fused
    Triton kernels; the model, caches and per-request table are ExecutorCore's, as
    ModelExecutor's.

    Build it with ``create(config)``; ``start(options)`` allocates its buffers and
    captures graphs (``create`` calls it).
    """

    def __init__(self, model: CausalLM, *, model_path: Path, num_kv_blocks: int,
                 block_size: int, max_model_len: int, num_state_slots: int = 0) -> None:
        super().__init__(model, model_path=model_path, num_kv_blocks=num_kv_blocks,
                         block_size=block_size, max_model_len=max_model_len,
                         num_state_slots=num_state_slots)
        self.options = CudaExecutorOptions()
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self._max_positions = model.rotary.max_positions
        self._started = False
        self.graph_capture_seconds = 0.0
        self.graph_memory_bytes = 0

    @classmethod
    def create(cls, config: EngineConfig, *, parallel: TensorParallel | None = None,
               device: torch.device | None = None) -> CudaModelExecutor:
        executor = cls.from_loaded(load_executor_model(config, parallel=parallel,
                                                       device=device))
        executor.start(CudaExecutorOptions.from_config(config, executor.device))
        return executor

    def reset_statistics(self) -> None:
        self.stats = ExecutorStatistics()

    def start(self, options: CudaExecutorOptions) -> None:
        """Allocate streams, slots and the block table; fuse kernels; capture graphs."""
        self.options = options
        # a model with linear-attention layers runs fused whatever the options: its
        # torch forward reads each sequence's slot on the host, which a graph cannot
        if options.use_fused_kernels or self.state_caches:
            from trio_llm.gpu.models.cuda_fused import fuse_model

            fuse_model(self.model)
        self.compute = Lane(self.device)
        # Uploads and downloads get a copy stream each: on one, the next step's upload
        # would queue behind this step's download, which waits for this step's compute.
        self.copy = Lane(self.device)
        self.download = Lane(self.device)
        num_ints, num_floats = upload_capacity(options.max_num_batched_tokens,
                                               options.max_num_seqs, self.block_size)
        self.slots = [new_slot(index, self.device, num_ints, num_floats, options.max_num_seqs)
                      for index in range(NUM_SLOTS)]
        # [slot, row]: the ids each slot's step sampled, where the next step reads them
        self.device_sampled = torch.zeros((NUM_SLOTS, options.max_num_seqs), dtype=torch.int64,
                                          device=self.device)
        num_table_rows = 2 * options.max_num_seqs + 8
        self.block_table = torch.zeros((num_table_rows, self.max_blocks_per_seq),
                                       dtype=torch.int32, device=self.device)
        self.planner = StepPlanner(self.table, vocab_size=self.vocab_size,
                                   max_blocks_per_seq=self.max_blocks_per_seq,
                                   num_table_rows=num_table_rows,
                                   num_state_slots=self.num_state_slots if self.state_caches
                                   else 0)
        self._outstanding: list[PendingStep] = []
        self.stats = ExecutorStatistics()
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, options.max_num_seqs,
                                          self.max_blocks_per_seq, self.device_sampled)
        self.varlen_graphs = VarlenGraphs(self.model, self.kv_caches,
                                          options.max_num_batched_tokens, options.max_num_seqs,
                                          self.max_blocks_per_seq, self.device_sampled)
        self._started = True
        cuda_startup.report_kv_cache(self)
        if options.use_fused_kernels:
            cuda_startup.warm_up(self)
        if options.use_cuda_graphs:
            cuda_startup.capture_graphs(self)

    # -- the split API ---------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Launch one step and wait for it (depth 1)."""
        return self.collect(self.launch(batch))

    def launch(self, batch: ScheduledBatch) -> PendingStep:
        """Enqueue one step and return at once; at most two steps may be outstanding."""
        started = time.perf_counter()
        pending, kind = self._launch(batch)
        elapsed = time.perf_counter() - started
        self.stats.launch_seconds += elapsed
        if kind is not None:
            self.stats.launch_seconds_by_kind[kind] += elapsed
        return pending

    def _launch(self, batch: ScheduledBatch) -> tuple[PendingStep, str | None]:
        assert self._started, "call start() (or build with create()) first"
        assert len(self._outstanding) < NUM_SLOTS, "collect a step before launching a third"
        started = time.perf_counter()
        if len(batch.requests) > self.device_sampled.shape[1]:
            self._grow_device_sampled(len(batch.requests))
        self._update_states(batch)
        step = self._plan(batch)
        if step.num_tokens == 0:
            self._copy_states(step)
            return PendingStep(step_id=batch.step_id, request_ids=[], done=DoneEvent()), None
        kind = step.kind
        self._pad_for_graph(step)
        slot = self.slots[self.planner.num_launches % NUM_SLOTS]
        stats = self.stats
        stats.plan_seconds_by_kind[kind] += time.perf_counter() - started
        if slot.upload_done is not None:
            waiting = time.perf_counter()
            slot.upload_done.synchronize()  # its pinned inputs are free to rewrite
            stats.launch_wait_seconds_by_kind[kind] += time.perf_counter() - waiting
        pending = self._launch_on_device(step, slot)
        stats.num_steps += 1
        stats.num_steps_by_kind[kind] += 1
        if step.graph_key is not None:
            stats.num_graph_steps += 1
            stats.num_graph_steps_by_kind[kind] += 1
        self.planner.remember_sampled(step, slot.index * self.device_sampled.shape[1])
        self._outstanding.append(pending)
        return pending, kind

    def supply_bitmasks(self, pending: PendingStep, token_bitmasks: list[bytes]) -> None:
        """Enqueue the sampling of a step launched with rows whose bitmasks follow:
        ``token_bitmasks`` are theirs, in batch order (StepBitmasks).

        On the critical path at depth 2 (the device waits for it when the forward pass
        is done first), so it does as little as it can on the host: the masks go
        straight into one pinned buffer with their rows' indices, and up in one copy."""
        forward = pending.forward
        assert forward is not None, "this step is not waiting for bitmasks"
        started = time.perf_counter()
        awaiting = forward.step.rows_awaiting_bitmasks
        assert len(awaiting) == len(token_bitmasks), "one bitmask per row that waits"
        forward.plan, forward.inputs = self._with_bitmasks(forward, awaiting, token_bitmasks)
        self._enqueue_sampling(pending)
        self.stats.launch_seconds += time.perf_counter() - started

    def _with_bitmasks(self, forward: ForwardState, awaiting: list[int],
                       token_bitmasks: list[bytes]
                       ) -> tuple[SamplingPlan, DeviceSamplingInputs]:
        """The plan and device inputs of ``forward`` with every row's bitmask (those
        packed at launch and those that followed), uploaded on the compute stream."""
        rows, plan = forward.step.sampling_rows, forward.plan
        if plan.bitmask_rows:  # a request's first token: its mask came with the batch
            masks = {index: rows[index].token_bitmask or b"" for index in plan.bitmask_rows}
            masks.update(zip(awaiting, token_bitmasks, strict=True))
            indices = sorted(masks)
            token_bitmasks = [masks[index] for index in indices]
        else:
            indices = awaiting
        host, words_start, num_words = stage_token_bitmasks(
            token_bitmasks, row_indices=indices, pin_memory=self.device.type == "cuda")
        plan = dataclasses.replace(plan, bitmask_rows=indices,
                                   bitmask_words=host.numpy()[words_start:],
                                   num_bitmask_words=num_words)
        with self.compute.context():
            uploaded = host.to(self.device, non_blocking=True)
            inputs = dataclasses.replace(forward.inputs,
                                         bitmask_rows=uploaded[:len(indices)],
                                         bitmask_words=uploaded[words_start:])
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
        prompt_results = []
        if pending.prompt_logprob_rows is not None and pending.prompt_hidden is not None:
            # the step is done: its hidden states are read on any stream
            with torch.inference_mode():
                prompt_results = prompt_logprobs(self.model.compute_logits,
                                                 pending.prompt_hidden,
                                                 pending.prompt_logprob_rows)
        # the step is done: its vectors are read on any stream
        pooled = [pooled_output(request_id, vector) for request_id, vector in pending.pooled]
        return StepResult(step_id=pending.step_id, request_ids=pending.request_ids,
                          sampled_token_ids=token_ids, logprobs=logprobs,
                          prompt_logprobs=prompt_results, pooled=pooled)

    def drain(self) -> None:
        """Wait for the steps launched and never collected (a runner cancelled at
        shutdown) and drop them, so that another engine can drive this executor."""
        for pending in list(self._outstanding):
            self.collect(pending)

    # -- host side: states, block table, inputs ------------------------------------------

    def _update_states(self, batch: ScheduledBatch) -> None:
        """Apply the batch's finishes and registrations."""
        planner = self.planner
        for request_id in batch.finished_request_ids:
            planner.forget(request_id)
        for new_request in batch.new_requests:
            planner.register(new_request)
            if planner.num_table_rows > self.block_table.shape[0]:
                self._grow_block_table()
            if new_request.sampling.has_penalties:
                with self.compute.context():  # ordered after the steps that used the row
                    self.table.register_penalties(new_request, self._token_ids_on_device)
        if self.state_caches and batch.new_requests:
            self.table.check_restored_states(batch)

    def _token_ids_on_device(self, token_ids: list[int]) -> torch.Tensor:
        if not token_ids:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return self._to_device(torch.tensor(token_ids, dtype=torch.int64))

    def _grow_block_table(self) -> None:
        old = self.block_table
        with self.compute.context():
            self.block_table = torch.zeros((self.planner.num_table_rows, old.shape[1]),
                                           dtype=old.dtype, device=self.device)
            self.block_table[:old.shape[0]].copy_(old)

    def _plan(self, batch: ScheduledBatch) -> HostStep:
        """The step's host-side inputs (gpu/cuda_plan.py)."""
        return self.planner.plan(batch)


    def _pad_for_graph(self, step: HostStep) -> None:
        """Choose the captured graph that fits the step, if any, and pad it to its sizes.
        Decode graphs compute logits for every row: only where every request samples.
        A step with prompt logprobs, or pooling, runs eagerly: a graph keeps no hidden
        states."""
        if step.prompt_logprob_rows.rows or step.pooling_chunks:
            return
        is_decode = step.num_tokens == step.num_seqs
        if is_decode and len(step.sampled_request_ids) == step.num_seqs:
            batch_size = self.decode_graphs.batch_size_for(step.num_seqs)
            if batch_size is not None:
                step.graph_key = ("decode", batch_size)
                pad_decode_sequences(step, batch_size)
                return
        num_tokens = self.varlen_graphs.num_tokens_for(step.num_tokens, step.num_seqs)
        if num_tokens is not None:
            step.graph_key = ("varlen", num_tokens)
            num_slots = self.varlen_graphs.num_seq_slots(num_tokens)
            pad_varlen_sequences(step, num_tokens, num_slots, num_slots - 1)

    # -- device side -------------------------------------------------------------------

    def _launch_on_device(self, step: HostStep, slot: InputSlot) -> PendingStep:
        started = time.perf_counter()
        plan = self._sampling_plan(step)
        int_offsets, float_offsets, num_words = self._pack(step, plan, slot)
        self.stats.pack_seconds_by_kind[step.kind] += time.perf_counter() - started
        self.copy.wait(slot.compute_done)  # the device inputs were read by then
        self.copy.copy(slot.device_ints[:num_words], slot.host_ints[:num_words])
        slot.upload_done = self.copy.record()
        with self.compute.context(), torch.inference_mode():
            self.compute.wait(slot.upload_done)
            self.compute.wait(slot.download_done)  # device_sampled was copied out by then
            compute_started = (self.compute.record(timing=True)
                               if self.options.measure_device_time else None)
            self._copy_states(step)
            ints = Segments(slot.device_ints, int_offsets)
            floats = Segments(slot.device_floats, float_offsets)
            logits = self._compute_logits(step, ints)
            pending = PendingStep(step_id=step.step_id, request_ids=step.sampled_request_ids,
                                  done=DoneEvent(), slot=slot,
                                  prompt_logprob_rows=step.prompt_logprob_rows,
                                  prompt_hidden=step.prompt_hidden, pooled=step.pooled,
                                  forward=ForwardState(step=step, plan=plan,
                                                       inputs=_sampling_inputs(ints, floats),
                                                       logits=logits,
                                                       compute_started=compute_started))
            if step.rows_awaiting_bitmasks:
                return pending
            self._sample(pending)  # in the same stream context: one fewer switch a step
        self._download(pending)
        return pending

    def _sampling_plan(self, step: HostStep) -> SamplingPlan:
        """The full plan where a row needs it, else the plain rows' (the usual step)."""
        can_fuse = self.options.use_fused_kernels
        if step.sampling_rows:
            return SamplingPlan.from_rows(step.sampling_rows, self.vocab_size, can_fuse=can_fuse)
        return SamplingPlan.from_plain_rows(step.row_values, step.ints["output_indices"],
                                            self.vocab_size, can_fuse=can_fuse)

    def _enqueue_sampling(self, pending: PendingStep) -> None:
        """Sample the step's logits on the compute stream, then download the ids."""
        with self.compute.context(), torch.inference_mode():
            self._sample(pending)
        self._download(pending)

    def _sample(self, pending: PendingStep) -> None:
        """Sample (on the current stream, the compute stream's) into device_sampled."""
        forward, slot = pending.forward, pending.slot
        assert forward is not None and slot is not None
        plan, logits = forward.plan, forward.logits
        sampled = sample_on_device(logits, plan, forward.inputs, self.penalty_counts)
        record_on_device(self.penalty_counts, plan, forward.inputs, sampled)
        num_rows = len(pending.request_ids)
        self.device_sampled[slot.index, :num_rows].copy_(sampled)
        wants_logprobs = plan.num_logprobs.count(None) < num_rows
        # a graph's logits buffer is rewritten by its next replay, which may come
        # before this step is collected
        pending.logits = logits.clone() if wants_logprobs else None
        pending.sampled = sampled if wants_logprobs else None
        slot.compute_done = self.compute.record(timing=forward.compute_started is not None)

    def _download(self, pending: PendingStep) -> None:
        """Copy the sampled ids to the host once sampled; their event marks the step done."""
        forward, slot = pending.forward, pending.slot
        assert forward is not None and slot is not None
        num_rows = len(pending.request_ids)
        self.download.wait(slot.compute_done)
        self.download.copy(slot.host_sampled[:num_rows], self.device_sampled[slot.index, :num_rows])
        slot.download_done = self.download.record(blocking=True)
        pending.done = slot.download_done
        pending.num_logprobs = forward.plan.num_logprobs
        pending.compute_started, pending.compute_done = forward.compute_started, slot.compute_done
        pending.forward = None

    def _pack(self, step: HostStep, plan: SamplingPlan, slot: InputSlot
              ) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]], int]:
        """Fill the slot's pinned upload: (int offsets, float offsets, words to copy)."""
        ints = step.ints
        ints["top_ks"], ints["seed_keys"] = plan.top_ks, plan.seed_keys
        ints["banned_rows"], ints["banned_token_ids"] = plan.banned_rows, plan.banned_token_ids
        ints["bitmask_rows"] = plan.bitmask_rows
        ints["bitmask_words"] = plan.bitmask_words  # type: ignore[assignment]  # an int64 array
        ints["allowed_rows"], ints["allowed_local_rows"] = (plan.allowed_rows,
                                                            plan.allowed_local_rows)
        ints["allowed_token_ids"] = plan.allowed_token_ids
        ints["logit_bias_rows"] = plan.logit_bias_rows
        ints["logit_bias_token_ids"] = plan.logit_bias_token_ids
        ints["penalty_rows"], ints["penalty_slots"] = plan.penalty_rows, plan.penalty_slots
        ints["prompt_logprob_rows"] = step.prompt_logprob_rows.rows
        floats = {"temperatures": plan.temperatures, "top_ps": plan.top_ps,
                  "min_ps": plan.min_ps, "logit_bias_values": plan.logit_bias_values,
                  "presences": plan.presences, "frequencies": plan.frequencies,
                  "repetitions": plan.repetitions}
        int_offsets, float_offsets, num_words = layout(
            {name: step.segment_length(name) for name in INT_SEGMENTS},
            {name: len(floats[name]) for name in FLOAT_SEGMENTS})
        self._ensure_capacity(slot, num_words, len(step.sampled_request_ids))
        fill(slot.host_ints.numpy(), int_offsets, ints, step.inserts)
        fill(slot.host_floats.numpy(), float_offsets, floats)
        return int_offsets, float_offsets, num_words

    def _compute_logits(self, step: HostStep, ints: Segments) -> torch.Tensor:
        """Logits of the step's sampled rows: a graph replay, or an eager forward."""
        self._apply_table_updates(ints)
        num_rows = len(step.sampled_request_ids)
        if step.graph_key is not None:
            family, size = step.graph_key
            graphs = self.decode_graphs if family == "decode" else self.varlen_graphs
            graphs.load(size, ints, self.block_table)  # the graph reads previous tokens
            return graphs.graphs[size].replay()[:num_rows]
        token_ids = ints["token_ids"]
        if step.num_tokens_from_device:
            token_ids = with_previous_tokens(token_ids, self.device_sampled)
        metadata = CudaStepMetadata(
            slot_mapping=ints["slot_mapping"],
            block_tables=self.block_table.index_select(0, ints["table_rows"]),
            context_lens=ints["context_lens"].to(torch.int32),
            query_start_loc=ints["query_start_loc"].to(torch.int32),
            state_slot_ids=ints["state_slots"] if self.state_caches else None,
            is_decode=step.num_tokens == step.num_seqs,  # unpadded: one token each
        )
        hidden = self.model(token_ids, ints["positions"], self.kv_caches, metadata)
        if ints.length("prompt_logprob_rows"):
            step.prompt_hidden = hidden.index_select(0, ints["prompt_logprob_rows"])
        if step.pooling_chunks:
            step.pooled = pooled_vectors(hidden, step.pooling_chunks)
        return self.model.compute_logits(hidden.index_select(0, ints["logits_indices"]))

    def _copy_states(self, step: HostStep) -> None:
        """The batch's state copies, in order, on the compute stream (the current one):
        after every step launched before, before this step's forward."""
        if step.state_copies and self.state_store is not None:
            with self.compute.context(), torch.inference_mode():
                copy_state_slots(self.state_store, step.state_copies)

    def _apply_table_updates(self, ints: Segments) -> None:
        if ints.length("update_indices"):
            self.block_table.view(-1).index_copy_(0, ints["update_indices"],
                                                  ints["update_block_ids"].to(torch.int32))

    # -- buffers -------------------------------------------------------------------------

    def _ensure_capacity(self, slot: InputSlot, num_words: int, num_sampled: int) -> None:
        """Grow this slot's buffers (rare: waits for the device first)."""
        if num_words <= slot.host_ints.shape[0] and num_sampled <= slot.host_sampled.shape[0]:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        grown = new_slot(slot.index, self.device, max(num_words, 2 * slot.host_ints.shape[0]),
                         0, max(num_sampled, slot.host_sampled.shape[0]))
        slot.host_ints, slot.host_floats = grown.host_ints, grown.host_floats
        slot.device_ints, slot.device_floats = grown.device_ints, grown.device_floats
        slot.host_sampled = grown.host_sampled

    def _grow_device_sampled(self, num_rows: int) -> None:
        """Widen device_sampled for a step of more rows than max_num_seqs (rare: waits
        for the device). Ids still to be read keep their (slot, row); the graphs read the
        old buffer, so they are dropped and every later step runs eagerly."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        old = self.device_sampled
        old_width = old.shape[1]
        self.device_sampled = torch.zeros((NUM_SLOTS, num_rows), dtype=torch.int64,
                                          device=self.device)
        self.device_sampled[:, :old_width].copy_(old)
        self.planner.widen_sampled(old_width, num_rows)
        if self.decode_graphs.graphs or self.varlen_graphs.graphs:
            logger.warning("a step of %d sequences, more than max_num_seqs (%d): CUDA graphs "
                           "dropped, steps run eagerly from now on", num_rows, old_width)
            self.decode_graphs.graphs.clear()
            self.varlen_graphs.graphs.clear()

    @property
    def graphs(self) -> dict[int, Any]:
        """The decode graphs by batch size (benchmarks replay them)."""
        return self.decode_graphs.graphs


# -- helpers -----------------------------------------------------------------------------


def stage_token_bitmasks(token_bitmasks: list[bytes], *, row_indices: list[int],
                         pin_memory: bool) -> tuple[torch.Tensor, int, int]:
    """(host buffer of int64s, where the masks start in it, number of int32 words of
    masks): ``row_indices`` first, then the masks one after the other (an odd word
    count padded), as the sampler's ``bitmask_rows`` and ``bitmask_words`` read them,
    so one upload carries both. The masks start 16-byte aligned: Triton specialises
    the mask kernel on its pointers' alignment (and would compile again mid-run)."""
    packed = b"".join(token_bitmasks)  # one pass in C: cheaper than a copy per mask
    num_words = len(packed) // 4
    words_start = len(row_indices) + len(row_indices) % 2
    # straight into (cached) pinned memory: a megabyte a step at 64 rows of 152k ids
    host = torch.empty(words_start + (num_words + 1) // 2, dtype=torch.int64,
                       pin_memory=pin_memory)
    values = host.numpy()
    values[:len(row_indices)] = row_indices
    view = values[words_start:].view(np.uint8)
    view[:len(packed)] = np.frombuffer(packed, dtype=np.uint8)
    view[len(packed):] = 0  # an odd word count's padding
    return host, words_start, num_words


def _sampling_inputs(ints: Segments, floats: Segments) -> DeviceSamplingInputs:
    """The plan's device inputs: views of the upload, only of the segments it filled (a
    view costs a few microseconds of the host's time; most steps use eight)."""
    optional = {name: segments[name]
                for segments, names in ((ints, OPTIONAL_INT_INPUTS),
                                        (floats, OPTIONAL_FLOAT_INPUTS))
                for name in names if segments.length(name)}
    return DeviceSamplingInputs(
        temperatures=floats["temperatures"], top_ps=floats["top_ps"], min_ps=floats["min_ps"],
        top_ks=ints["top_ks"], seed_keys=ints["seed_keys"],
        output_indices=ints["output_indices"],
        banned_rows=ints["banned_rows"], banned_token_ids=ints["banned_token_ids"],
        **optional)


# DeviceSamplingInputs' fields that default to empty: set only where the plan has them
OPTIONAL_INT_INPUTS = ("bitmask_rows", "bitmask_words", "allowed_rows", "allowed_local_rows",
                       "allowed_token_ids", "logit_bias_rows", "logit_bias_token_ids",
                       "penalty_rows", "penalty_slots")
OPTIONAL_FLOAT_INPUTS = ("logit_bias_values", "presences", "frequencies", "repetitions")
