"""The model executor: the one synchronous object the runner actor drives.

It owns the model, the paged KV cache and the state each running request needs
between steps (its block table, its sampling options, the token it sampled
last). ``execute`` runs one ScheduledBatch exactly as the scheduler built it:

1. forget ``finished_request_ids``; register ``new_requests`` (with the state slot
   the scheduler gave each, for a model with linear-attention layers);
2. extend each request's block table with its ``new_block_ids``; make the batch's
   ``state_copies`` between state slots;
3. flatten every request's input tokens into one varlen forward (a request with
   ``input_from_previous_step`` takes the token sampled for it last step);
4. sample the rows that have ``sample`` set, keyed by their ``output_index``,
   and count the tokens of the rows with penalties (gpu/penalties.py);
5. pool the rows of embedding requests (gpu/pooling.py): the last chunk of each
   (``pool``) returns its vector instead of a sampled token.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import (
    ScheduledBatch,
    ScheduledRequest,
    StepResult,
)
from trio_llm.gpu.builtin import is_dummy_only, resolve_model
from trio_llm.gpu.loader import load_model, resolve_device, resolve_dtype
from trio_llm.gpu.models import ModelConfig, ModelLoadError, read_model_config
from trio_llm.gpu.models.base import AttentionMetadata, CausalLM, StateCache, StateStore
from trio_llm.gpu.pooling import PoolingChunk, pool, pooling_chunk
from trio_llm.gpu.request_table import RequestState, RequestTable
from trio_llm.gpu.sampler import (
    PromptLogprobRows,
    SamplingRow,
    prompt_logprobs,
    record_sampled,
    sample,
)
from trio_llm.gpu.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

GIB = 2**30
# Chunks at least this long compute their KV slots with NumPy: cheaper than a Python
# loop past about a hundred tokens (an 8,192-token chunk: 1.0 -> 0.16 ms on a 2-core
# development machine).
MIN_VECTORIZED_SLOTS = 128
# The share of the cache budget that prefix-cache state snapshots take, unless
# max_state_snapshots says how many (docs/architecture.md, hybrid models).
SNAPSHOT_SHARE = 0.25


def kv_slots(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """The KV-cache slots of positions ``start`` to ``end - 1`` of a request whose
    blocks are ``block_ids`` (slot = block id * block size + offset)."""
    if end - start < MIN_VECTORIZED_SLOTS:
        return [block_ids[position // block_size] * block_size + position % block_size
                for position in range(start, end)]
    return kv_slot_array(block_ids, block_size, start, end).tolist()


def kv_slot_array(block_ids: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """kv_slots as an int64 array (the CUDA executor packs long chunks from arrays)."""
    positions = np.arange(start, end)
    first_block = start // block_size
    blocks = np.asarray(block_ids[first_block:(end - 1) // block_size + 1], dtype=np.int64)
    return blocks[positions // block_size - first_block] * block_size + positions % block_size


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What an engine needs to know of a model before loading its weights."""

    model_path: Path
    model_config: ModelConfig
    max_model_len: int

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size


@dataclass(slots=True)
class StepInputs:
    """One step's flattened inputs, on the host."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    logits_indices: list[int] = field(default_factory=list)
    sampling_rows: list[SamplingRow] = field(default_factory=list)
    sampled_request_ids: list[str] = field(default_factory=list)
    prompt_logprob_rows: PromptLogprobRows = field(
        default_factory=lambda: PromptLogprobRows([], [], []))
    pooling_chunks: list[PoolingChunk] = field(default_factory=list)
    # linear-attention layers: each sequence's state slot, and whether it continues
    state_slots: list[int] = field(default_factory=list)
    continues_state: list[bool] = field(default_factory=list)


class ExecutorCore:
    """What both executors (ModelExecutor and gpu/cuda_executor.py's) hold: the model,
    every layer's cache (KV pairs, and a linear-attention layer's state slots) and the
    per-request table."""

    def __init__(self, model: CausalLM, *, model_path: Path, num_kv_blocks: int,
                 block_size: int, max_model_len: int, num_state_slots: int = 0) -> None:
        self.model = model
        self.model_path = model_path
        self.device = model.device
        self.dtype = model.dtype
        self.vocab_size = model.config.vocab_size
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_state_slots = num_state_slots
        # every linear-attention layer's states, slot-major (None without such layers)
        self.state_store = model.allocate_state_store(num_state_slots)
        self.kv_caches = model.allocate_caches(num_kv_blocks, block_size, self.state_store)
        self.state_caches = [cache for cache in self.kv_caches if isinstance(cache, StateCache)]
        self.table = RequestTable(vocab_size=self.vocab_size, device=self.device,
                                  block_size=block_size,
                                  max_positions=model.rotary.max_positions)
        self.penalty_counts = self.table.penalty_counts

    @classmethod
    def from_loaded(cls, loaded: LoadedModel) -> Self:
        """The executor of a model ``load_executor_model`` loaded and sized."""
        return cls(loaded.model, model_path=loaded.model_path,
                   num_kv_blocks=loaded.num_kv_blocks, block_size=loaded.block_size,
                   max_model_len=loaded.max_model_len, num_state_slots=loaded.num_state_slots)

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.table.states


class ModelExecutor(ExecutorCore):
    """Runs ScheduledBatches on one model and its paged KV cache."""

    @classmethod
    def describe(cls, config: EngineConfig) -> ModelDescription:
        """Resolve the model and read its config.json; loads no weights."""
        model_path = resolve_model(config.model, config.revision)
        model_config = read_model_config(model_path)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        return ModelDescription(model_path=model_path, model_config=model_config,
                                max_model_len=max_model_len)

    @classmethod
    def create(cls, config: EngineConfig, *, parallel: TensorParallel | None = None,
               device: torch.device | None = None) -> ModelExecutor:
        """Resolve and load the model, then size and allocate the KV cache (see
        ``load_executor_model``)."""
        loaded = load_executor_model(config, parallel=parallel, device=device)
        logger.info("%s", kv_cache_summary(loaded.model, loaded.num_kv_blocks,
                                           loaded.block_size))
        return cls.from_loaded(loaded)

    # -- one step ----------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step; the result lists the sampled requests in batch order."""
        self._update_states(batch)
        inputs = self._build_inputs(batch.requests)
        if not inputs.token_ids:
            return StepResult(step_id=batch.step_id, request_ids=[], sampled_token_ids=[])
        with torch.inference_mode():
            hidden = self._forward(inputs)
            pooled = pool(hidden, inputs.pooling_chunks) if inputs.pooling_chunks else []
            if not inputs.sampling_rows:  # embedding requests only
                return StepResult(step_id=batch.step_id, request_ids=[],
                                  sampled_token_ids=[], pooled=pooled)
            logits = self.model.compute_logits(hidden[self._tensor(inputs.logits_indices)])
            output = sample(logits, inputs.sampling_rows, self.penalty_counts)
            record_sampled(self.penalty_counts, inputs.sampling_rows, output.token_ids)
            asked = inputs.prompt_logprob_rows
            prompt_results = (prompt_logprobs(self.model.compute_logits,
                                              hidden[self._tensor(asked.rows)], asked)
                              if asked.rows else [])
        token_ids = output.token_ids.tolist()
        for request_id, token_id in zip(inputs.sampled_request_ids, token_ids, strict=True):
            self.requests[request_id].last_sampled_token_id = token_id
        return StepResult(step_id=batch.step_id, request_ids=inputs.sampled_request_ids,
                          sampled_token_ids=token_ids, logprobs=output.logprobs,
                          prompt_logprobs=prompt_results, pooled=pooled)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _update_states(self, batch: ScheduledBatch) -> None:
        table = self.table
        for request_id in batch.finished_request_ids:
            table.remove(request_id)
        for new_request in batch.new_requests:
            table.add(new_request)
            table.register_penalties(new_request, self._token_ids_on_device)
        for scheduled in batch.requests:
            table.state(scheduled.request_id).block_ids.extend(scheduled.new_block_ids)
        if self.state_store is not None:
            copy_state_slots(self.state_store, batch.state_copies)
            self.table.check_restored_states(batch)

    def _token_ids_on_device(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor(token_ids, dtype=torch.int64).to(self.device)

    def _build_inputs(self, requests: Sequence[ScheduledRequest]) -> StepInputs:
        inputs = StepInputs()
        for scheduled in requests:
            self._add_request(inputs, scheduled)
        return inputs

    def _add_request(self, inputs: StepInputs, scheduled: ScheduledRequest) -> None:
        state = self.table.state(scheduled.request_id)
        token_ids = self._input_token_ids(scheduled, state)
        start = scheduled.num_computed_tokens
        context_len = start + len(token_ids)
        self.table.check_capacity(scheduled.request_id, state, context_len)
        positions = range(start, context_len)
        if scheduled.prompt_logprob_token_ids:  # the chunk's first positions
            inputs.prompt_logprob_rows.add(scheduled.request_id, len(inputs.token_ids),
                                           scheduled.prompt_logprob_token_ids,
                                           state.sampling.num_prompt_logprobs or 0)
        if state.pooling is not None:
            chunk = pooling_chunk(scheduled, state.pooling, state.mean_pool,
                                  len(inputs.token_ids))
            if chunk is not None:
                inputs.pooling_chunks.append(chunk)
        inputs.token_ids += token_ids
        inputs.positions += positions
        inputs.slot_mapping += kv_slots(state.block_ids, self.block_size, start, context_len)
        inputs.block_tables.append(state.block_ids)
        if self.state_caches:
            inputs.state_slots.append(self.table.state_slot(scheduled.request_id, state,
                                                            self.num_state_slots))
            inputs.continues_state.append(start > 0)
        inputs.context_lens.append(context_len)
        inputs.query_start_loc.append(len(inputs.token_ids))
        if scheduled.sample:
            inputs.logits_indices.append(len(inputs.token_ids) - 1)
            inputs.sampling_rows.append(SamplingRow(
                state.sampling, scheduled.output_index, scheduled.token_bitmask,
                self.penalty_counts.slot(scheduled.request_id)))
            inputs.sampled_request_ids.append(scheduled.request_id)

    @staticmethod
    def _input_token_ids(scheduled: ScheduledRequest, state: RequestState) -> list[int]:
        if not scheduled.input_from_previous_step:
            return scheduled.token_ids
        if state.last_sampled_token_id is None:
            raise ValueError(f"request {scheduled.request_id!r} takes its input from the "
                             f"previous step, but nothing was sampled for it")
        return [state.last_sampled_token_id]

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        device = self.device

        def tensor(values: list[int] | list[list[int]],
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        max_blocks = max(len(row) for row in inputs.block_tables)
        padded_tables = [row + [0] * (max_blocks - len(row)) for row in inputs.block_tables]
        metadata = AttentionMetadata(
            slot_mapping=tensor(inputs.slot_mapping),
            block_tables=tensor(padded_tables, torch.int32),
            context_lens=tensor(inputs.context_lens, torch.int32),
            query_start_loc=tensor(inputs.query_start_loc, torch.int32),
            state_slots=inputs.state_slots if self.state_caches else None,
            continues_state=inputs.continues_state if self.state_caches else None,
        )
        return self.model(tensor(inputs.token_ids), tensor(inputs.positions),
                          self.kv_caches, metadata)


def copy_state_slots(state_store: StateStore, copies: Sequence[tuple[int, int]]) -> None:
    """Make a batch's ``state_copies`` (source slot, destination slot) in order (a copy
    may read a slot an earlier one wrote): each one copy per state tensor, every
    linear-attention layer's states at once."""
    num_slots = state_store.num_slots
    for source, destination in copies:
        if not (0 <= source < num_slots and 0 <= destination < num_slots):
            raise ValueError(f"state copy {source} -> {destination} names a slot outside "
                             f"0..{num_slots - 1}")
        state_store.copy_slot(source, destination)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A loaded model and the sizes of the caches an executor allocates for it: the KV
    blocks, and (a model with linear-attention layers) the state slots."""

    model: CausalLM
    model_path: Path
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    num_state_slots: int = 0


def load_executor_model(config: EngineConfig, *, parallel: TensorParallel | None = None,
                    device: torch.device | None = None) -> LoadedModel:
    """Resolve and load the model, and size its KV cache (an executor's start, the CPU's
    and CUDA's alike). With ``parallel`` (a tensor-parallel worker, gpu/tp_worker.py):
    this rank's shard on ``device``, and as many KV blocks as every rank can hold."""
    description = ModelExecutor.describe(config)
    device = device or resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    torch.manual_seed(config.seed)
    model = load_model(description.model_path, dtype=dtype, device=device,
                       load_format=_load_format(config),
                       max_positions=max(description.max_model_len,
                                         description.model_config.max_position_embeddings),
                       parallel=parallel, quantization=config.quantization,
                       kv_cache=config.kv_cache_dtype)
    num_state_slots = model.parallel.min_over_ranks(_num_state_slots(model, config), device)
    state_bytes = num_state_slots * model.state_bytes_per_slot
    num_kv_blocks = config.num_kv_blocks or _num_kv_blocks_for_memory(model, config,
                                                                      state_bytes)
    num_kv_blocks = model.parallel.min_over_ranks(num_kv_blocks, device)
    if num_state_slots:
        logger.info("%d state slots of %.1f MiB (%d for running requests, %d for prefix-cache "
                    "snapshots; %.2f GiB), %d KV tokens for the %d full-attention layers",
                    num_state_slots, model.state_bytes_per_slot / 2**20, config.max_num_seqs,
                    num_state_slots - config.max_num_seqs, state_bytes / GIB,
                    num_kv_blocks * config.block_size, model.num_attention_layers)
    if device.type == "cpu":
        configure_cpu_threads()
        model.attention_backend.warm_up()
        if model.num_linear_attention_layers:
            from trio_llm.gpu.kernels import cpu_linear_attention

            cpu_linear_attention.warm_up()
        _fuse_cpu_model(model)
    return LoadedModel(model=model, model_path=description.model_path,
                       num_kv_blocks=num_kv_blocks, block_size=config.block_size,
                       max_model_len=description.max_model_len,
                       num_state_slots=num_state_slots)


def kv_cache_summary(model: CausalLM, num_kv_blocks: int, block_size: int) -> str:
    """The start-up line about the KV cache: its size in blocks, tokens and bytes, and its
    dtype (an FP8 cache says how many more tokens it holds than the model's dtype would)."""
    num_tokens = num_kv_blocks * block_size
    num_bytes = num_tokens * model.kv_cache_bytes_per_token  # this rank's KV heads
    dtype = str(model.kv_cache_dtype).removeprefix("torch.")
    if model.kv_cache_dtype != model.dtype:
        ratio = model.dtype.itemsize / model.kv_cache_dtype.itemsize
        dtype += f": {ratio:g}x the tokens of a {str(model.dtype).removeprefix('torch.')} cache"
    return (f"KV cache: {num_kv_blocks} blocks of {block_size} tokens = {num_tokens} tokens, "
            f"{num_bytes / GIB:.2f} GiB, {dtype} ({model.device})")


def configure_cpu_threads() -> int:
    """Set and return torch's intra-op threads for an engine on the CPU: at most every
    core but one, which the trio thread (scheduler, detokenizer, request streams) needs
    while the model runs in the runner's worker thread; never fewer than one, and never
    more than already set (a process that asked for fewer keeps them). An explicit
    ``OMP_NUM_THREADS`` wins. The attention kernel follows the same count. Measured in
    docs/performance.md (CPU): on the shared 2-core machine 1 thread was as fast as 2 in
    wall time within the noise, and cheaper in CPU time per token on the first workload."""
    if "OMP_NUM_THREADS" not in os.environ:
        num_cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                     else os.cpu_count() or 1)
        torch.set_num_threads(max(1, min(torch.get_num_threads(), num_cores - 1)))
    return torch.get_num_threads()


def _fuse_cpu_model(model: CausalLM) -> None:
    """Run a float32 model through gpu/kernels/cpu_layers.py's kernels (gpu/models/cpu_fused.py;
    compiled now, not in the first step), where their shapes allow: a step in parts on
    ``cpu_forward_threads()`` threads, each part's ops on its own thread (torch's intra-op
    threads: 1)."""
    from trio_llm.gpu.kernels import cpu_layers
    from trio_llm.gpu.models import cpu_fused

    if cpu_fused.can_fuse(model):
        cpu_layers.warm_up()
        cpu_fused.fuse_model(model, num_parts=cpu_forward_threads())
        torch.set_num_threads(1)


def cpu_forward_threads() -> int:
    """The threads a fused CPU model splits a step over: ``OMP_NUM_THREADS`` where set,
    else every core. Unlike OpenMP's threads, which wait for each other at every
    operation (and, measured on the shared 2-core machine, ran a decode step 3 to 10
    times slower at 2 threads than at 1 whenever a core was busy), a part runs its whole
    forward alone: a core shared with the trio thread, or another process, costs only
    that share (docs/performance.md, CPU)."""
    if "OMP_NUM_THREADS" in os.environ:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count() or 1)


def _load_format(config: EngineConfig) -> str:
    """Built-in names without weights on disk load dummy weights, and only those."""
    if not is_dummy_only(config.model):
        return config.load_format
    if config.load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"built-in model {config.model!r} has no weights on disk; "
                             f"it loads with load_format='dummy' only")
    if config.load_format == "auto":
        logger.warning("model %r is a built-in configuration with RANDOM weights: its output "
                       "is noise, fit for measuring speed only (pass --load-format dummy to "
                       "say so, or a model directory or ORG/NAME for real weights)",
                       config.model)
    return "dummy"


def _cache_budget_bytes(model: CausalLM, config: EngineConfig) -> float:
    """The memory the caches may take: ``cpu_kv_cache_gib`` on the CPU, the free share of
    ``gpu_memory_utilization`` on CUDA."""
    if model.device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(model.device)
        return free_bytes - (1.0 - config.gpu_memory_utilization) * total_bytes
    return config.cpu_kv_cache_gib * GIB


def _num_state_slots(model: CausalLM, config: EngineConfig) -> int:
    """A model with linear-attention layers: a state slot for each running sequence
    (``max_num_seqs``), and with prefix caching on, slots for prefix-cache snapshots:
    ``max_state_snapshots`` where set, else as many as a quarter of the cache budget
    holds (at least one). 0 for other models."""
    slot_bytes = model.state_bytes_per_slot
    if not slot_bytes:
        return 0
    num_snapshot_slots = 0
    if config.enable_prefix_caching:
        num_snapshot_slots = getattr(config, "max_state_snapshots", None) or max(
            1, int(_cache_budget_bytes(model, config) * SNAPSHOT_SHARE // slot_bytes))
    return config.max_num_seqs + num_snapshot_slots


def _num_kv_blocks_for_memory(model: CausalLM, config: EngineConfig,
                              state_bytes: int = 0) -> int:
    """As many blocks as the memory budget holds once the state slots (``state_bytes``)
    have theirs."""
    bytes_per_block = config.block_size * model.kv_cache_bytes_per_token
    cache_bytes = _cache_budget_bytes(model, config)
    budget = cache_bytes - state_bytes
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1 and state_bytes and cache_bytes > 0:
        # each running sequence's state slot comes first: a hybrid model at the default
        # max_num_seqs can need more than the memory left after its weights. Refused
        # with the number that fits, not capped, as vLLM does for its Mamba cache blocks
        num_fitting = int(cache_bytes / 2 // model.state_bytes_per_slot)
        memory_flag = ("--gpu-memory-utilization" if model.device.type == "cuda"
                       else "--cpu-kv-cache-gib")
        raise ModelLoadError(
            f"no memory left for the KV cache: {config.max_num_seqs} running sequences "
            f"(--max-num-seqs) and the prefix-cache snapshots take {state_bytes / GIB:.2f} GiB "
            f"of state slots ({model.state_bytes_per_slot / 2**20:.1f} MiB each), the caches "
            f"may take {cache_bytes / GIB:.2f} GiB: pass --max-num-seqs {num_fitting} or "
            f"fewer (their states in half of it), or give the caches more memory "
            f"({memory_flag})")
    if num_blocks < 1:
        raise ModelLoadError(f"no memory left for the KV cache ({budget / GIB:.2f} GiB budget "
                             f"after {state_bytes / GIB:.2f} GiB of state slots, "
                             f"{bytes_per_block} bytes per block)")
    return num_blocks
