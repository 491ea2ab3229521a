"""Any family's model on the CPU: its fused forward through the numba kernels, in parts.

``fuse_model(model)`` makes a loaded float32 CausalLM on the CPU run its forward
through gpu/kernels/cpu_layers.py's kernels and the CPU attention kernel,
keeping its weights; the layout checks of the attention kernel then run once per
step, not once per layer. A step is split into parts of whole sequences, each
on its own thread (``split_step``). For the dense family each part goes further:
its whole forward is one compiled call, ``_forward_layers``, which holds no GIL
and gives the bits of the same model in torch operations.

Every row's result is independent of the rest of the step (the kernels work row
by row, the linear layers in fixed row chunks): the model stays batch-invariant
whichever way a step is cut.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from trio_llm.gpu.kernels import cpu_attention, cpu_layers
from trio_llm.gpu.kernels.cpu_attention import LANES
from trio_llm.gpu.kernels.cpu_blas import ROWS_PER_CHUNK, sgemm_address
from trio_llm.gpu.kernels.cpu_layers import _forward_layers, _linear_chunks
from trio_llm.gpu.layers.attention import AttentionMetadata, KVCache
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.layers.mlp import MLP
from trio_llm.gpu.layers.moe import expert_loop, torch_route
from trio_llm.gpu.models.base import CausalLM
from trio_llm.gpu.quantization import Fp8Activation, KVScales, quantize_row_groups


class CpuOps:
    """gpu/kernels/cpu_layers.py's kernels as the FusedOps a model's fused forward calls
    (gpu/layers/fused_ops.py), ``step`` the CPU attention kernel's StepPlan; the experts
    of an MoE block in fixed row chunks (batch-invariant)."""

    rms_norm = staticmethod(cpu_layers.rms_norm)
    add_rms_norm = staticmethod(cpu_layers.add_rms_norm)

    @staticmethod
    def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[Fp8Activation, torch.Tensor]:
        """(Never called: the CPU keeps no FP8 layers.) The norm, then its rows rounded."""
        if residual is None:
            normed, residual = cpu_layers.rms_norm(x, weight, eps), x
        else:
            normed, residual = cpu_layers.add_rms_norm(x, residual, weight, eps)
        values, scales = quantize_row_groups(normed, normed.shape[1])
        return Fp8Activation(values, scales, normed.dtype), residual

    @staticmethod
    def gate_up_silu(hidden: torch.Tensor | Fp8Activation, gate_up_proj: Linear, *,
                     quantize: bool = False) -> torch.Tensor | Fp8Activation:
        activated = cpu_layers.silu_and_mul(gate_up_proj(hidden))
        if not quantize:
            return activated
        values, scales = quantize_row_groups(activated, activated.shape[1])
        return Fp8Activation(values, scales, activated.dtype)

    @staticmethod
    def qk_norm_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, q_norm: torch.Tensor | None,
                              k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                              num_heads: int, num_kv_heads: int, head_dim: int,
                              kv_scales: KVScales) -> torch.Tensor:
        # (a model with an FP8 cache is not fused: can_fuse)
        return cpu_layers.qk_norm_rope_write_kv(
            qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping,
            num_heads=num_heads, num_kv_heads=num_kv_heads)

    @staticmethod
    def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: Any,
               scale: float, backend: Any, kv_scales: KVScales) -> torch.Tensor:
        return cpu_attention.attend(step, query, k_cache, v_cache, scale)

    # transformers' own torch routing (ties as torch.topk on the CPU breaks them)
    moe_route = staticmethod(torch_route)

    @staticmethod
    def moe_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    weights: torch.Tensor, expert_ids: torch.Tensor,
                    num_rows_per_chunk: int, scales: Any = None) -> torch.Tensor:
        assert scales is None, "the CPU dequantizes FP8 experts at load"
        return expert_loop(hidden, gate_up, down, weights, expert_ids, cpu_layers.silu_and_mul,
                           num_rows_per_chunk)


CPU_OPS = CpuOps()


def can_fuse(model: CausalLM) -> bool:
    """The kernels take float32 on the CPU, rows a whole number of lanes and even heads,
    and a float32 KV cache (an FP8 one runs unfused, through the torch reference); the
    fused forward has no collectives, so a tensor-parallel shard runs unfused."""
    config = model.config
    return (model.device.type == "cpu" and model.dtype == torch.float32
            and model.kv_cache_dtype == torch.float32
            and not model.parallel.is_parallel
            # the hybrid family's layers (linear attention, gated attention, partial
            # rotary, (1 + weight) norms) have no compiled kernels: they run in torch
            and model.num_linear_attention_layers == 0 and not config.attention_output_gate
            and not config.offset_norms and config.rotary_dim == config.head_dim
            and config.hidden_size % LANES == 0 and config.head_dim % LANES == 0
            and model.attention_backend.name == "cpu")


# A part of a step is worth a thread of its own from this many tokens. A part in torch
# operations runs every op of the forward, and the threads hand the GIL back and forth at
# each: a decode step of 64 sequences in two parts of 32 took 18 ms of CPU against 12 in
# one part (the shared 2-core machine), where a prefill of 8,313 tokens took the same CPU
# either way.
MIN_TOKENS_PER_PART = 256
# A part in one compiled call holds the GIL only to start: its cost is its GEMM chunks.
# From this many tokens a step has two parts (a decode step of 32 sequences: a chunk each).
MIN_TOKENS_PER_COMPILED_PART = ROWS_PER_CHUNK // 2
# What a token costs in its linear layers, counted in (query, key) pairs of attention
# (about 2.4 M multiply-adds against 8 heads x 64 per pair, for the model).
PAIRS_PER_TOKEN = 200


@dataclass(frozen=True, slots=True)
class StepPart:
    """Sequences ``first_seq..end_seq - 1`` of a step, its tokens ``first_token..end_token - 1``."""

    first_seq: int
    end_seq: int
    first_token: int
    end_token: int


def split_step(context_lens: np.ndarray, query_start_loc: np.ndarray, max_parts: int,
               min_tokens_per_part: int | None = None) -> list[StepPart]:
    """Contiguous runs of whole sequences of about equal work (tokens, plus attention pairs),
    at most ``max_parts`` and each at least ``min_tokens_per_part`` tokens (default
    MIN_TOKENS_PER_PART); a cut moves to a nearby edge of a GEMM chunk where a sequence
    ends there (decode steps), so that no part pads a chunk it could have filled."""
    min_tokens_per_part = min_tokens_per_part or MIN_TOKENS_PER_PART
    num_queries = np.diff(query_start_loc).astype(np.int64)
    num_tokens = int(query_start_loc[-1]) if len(query_start_loc) else 0
    num_parts = max(1, min(max_parts, num_tokens // min_tokens_per_part))
    costs = np.cumsum(num_queries * (PAIRS_PER_TOKEN + context_lens.astype(np.int64)))
    total = int(costs[-1]) if len(costs) else 0
    ends = _chunk_aligned_ends([int(np.searchsorted(costs, total * index / num_parts)) + 1
                                for index in range(1, num_parts)], query_start_loc)
    bounds = [0, *sorted({min(end, len(costs)) for end in ends}), len(costs)]
    return [StepPart(first, end, int(query_start_loc[first]), int(query_start_loc[end]))
            for first, end in zip(bounds, bounds[1:], strict=False) if end > first]


def reads_another_parts_writes(plan: cpu_attention.StepPlan, parts: list[StepPart],
                               num_blocks: int, block_size: int) -> bool:
    """Whether a sequence reads a cache block that another part writes in this step.

    With prefix caching a request may hit the blocks another request of the same step
    is computing (a repeated prompt): in one part every layer stores the step's keys and
    values before it attends, but parts on their own threads would race, and the reader
    could see the block before it is written. Such a step runs as one part."""
    slots = cast(torch.Tensor, plan.slot_mapping).numpy()
    writer = np.full(num_blocks, -1, dtype=np.int64)
    part_of_seq = np.empty(len(plan.context_lens), dtype=np.int64)
    for index, part in enumerate(parts):
        part_slots = slots[part.first_token:part.end_token]
        writer[part_slots[part_slots >= 0] // block_size] = index
        part_of_seq[part.first_seq:part.end_seq] = index
    num_used_blocks = -(-plan.context_lens.astype(np.int64) // block_size)
    is_used = np.arange(plan.block_tables.shape[1]) < num_used_blocks[:, None]
    writers = writer[plan.block_tables]
    return bool(((writers >= 0) & (writers != part_of_seq[:, None]) & is_used).any())


def _chunk_aligned_ends(ends: list[int], query_start_loc: np.ndarray) -> list[int]:
    """``ends`` (sequence counts), each moved to the nearest cut within half a chunk of its
    tokens where the part before it fills whole GEMM chunks, if that saves a chunk (a
    part pads its tokens to whole chunks: in a decode step, 30 + 34 tokens cost three)."""
    token_ends = query_start_loc.astype(np.int64)
    num_tokens, first_token = int(token_ends[-1]), 0
    aligned = []
    for end in ends:
        end = min(end, len(token_ends) - 1)
        distance = np.abs(token_ends - token_ends[end])
        fills_chunks = (token_ends - first_token) % ROWS_PER_CHUNK == 0
        candidates = np.flatnonzero(fills_chunks & (distance <= ROWS_PER_CHUNK // 2)
                                    & (token_ends > first_token) & (token_ends < num_tokens))
        if len(candidates):
            best = int(candidates[np.argmin(distance[candidates])])
            if (_num_chunks_around(int(token_ends[best]), first_token, num_tokens)
                    < _num_chunks_around(int(token_ends[end]), first_token, num_tokens)):
                end = best
        aligned.append(end)
        first_token = int(token_ends[end])
    return aligned


def _num_chunks_around(cut_token: int, first_token: int, num_tokens: int) -> int:
    """The GEMM chunks of the part that ends at ``cut_token`` and of the rest of the step."""
    def num_chunks(count: int) -> int:
        return -(-count // ROWS_PER_CHUNK)

    return num_chunks(cut_token - first_token) + num_chunks(num_tokens - cut_token)


class StackedLayers:
    """Every layer's weights of one kind as one [layer, ...] array, the layers' parameters
    made views of it (so nothing is stored twice), and the caches of the model's last
    ``allocate_kv_caches``: what ``_forward_layers`` takes, built once (a tuple of every
    layer's arrays built at each call cost some 0.16 ms of GIL-holding Python a part)."""

    def __init__(self, model: CausalLM) -> None:
        layers = model.decoder_layers

        def stack(parameters: list[torch.nn.Parameter | None]) -> np.ndarray:
            if any(parameter is None for parameter in parameters):
                return np.zeros((len(parameters), 1), dtype=np.float32)
            stacked = torch.stack([cast(torch.Tensor, parameter).detach()
                                   for parameter in parameters]).contiguous()
            for index, parameter in enumerate(parameters):
                cast(torch.nn.Parameter, parameter).data = stacked[index]
            return stacked.numpy()

        def norm_weights(norms: list[Any]) -> list[torch.nn.Parameter | None]:
            return [None if norm is None else norm.weight for norm in norms]

        self.norms = (stack([layer.input_layernorm.weight for layer in layers]),
                      stack([layer.post_attention_layernorm.weight for layer in layers]),
                      stack(norm_weights([layer.self_attn.q_norm for layer in layers])),
                      stack(norm_weights([layer.self_attn.k_norm for layer in layers])),
                      model.norm.weight.detach().numpy())
        kinds = ([layer.self_attn.qkv_proj for layer in layers],
                 [layer.self_attn.o_proj for layer in layers],
                 [cast(MLP, layer.mlp).gate_up_proj for layer in layers],
                 [cast(MLP, layer.mlp).down_proj for layer in layers])
        self.weights = tuple(stack([linear.weight for linear in linears]) for linears in kinds)
        self.biases = tuple(stack([linear.bias for linear in linears]) for linears in kinds)
        self.has_biases = np.array([linears[0].bias is not None for linears in kinds])
        self.caches: torch.Tensor | None = None

    @property
    def k_rows(self) -> np.ndarray:
        return self._rows(0)

    @property
    def v_rows(self) -> np.ndarray:
        return self._rows(1)

    def _rows(self, index: int) -> np.ndarray:
        caches = cast(torch.Tensor, self.caches)[index]
        return caches.view(caches.shape[0], -1, caches.shape[-1]).numpy()

    def holds(self, kv_caches: list[KVCache]) -> bool:
        """Whether ``kv_caches`` are the views of the caches allocated last."""
        caches = self.caches
        return (caches is not None and len(kv_caches) == caches.shape[1]
                and kv_caches[0][0].shape == caches.shape[2:]
                and kv_caches[0][0].data_ptr() == caches.data_ptr()
                and kv_caches[-1][1].data_ptr() == caches[1, -1].data_ptr())


class CpuFusedCausalLM(CausalLM):
    """A CausalLM whose forward runs through this module's kernels; see ``fuse_model``.

    A step's sequences are split into up to ``num_parts`` runs of about equal work, each
    run's whole forward on its own thread, every op inside a part on one thread: one
    compiled call (``_forward_layers``) where ``sgemm_address`` is set and the caches are
    the model's own, else torch ops and one kernel call per fused op (they release the
    GIL between them). Each part is a step of its own to the model: a row's result is
    the same bits whichever part, or company, it has, and whichever of the two ways
    ran it. In torch ops, a step too small for parts still spreads its attention (one
    hand-off per layer) over as many threads.
    """

    num_parts: int = 1
    # torch's sgemm_ (gpu/kernels/cpu_blas.py): a part runs in one compiled call; 0: in torch ops
    sgemm_address: int = 0
    # the weights and caches as the compiled forward takes them
    stacked: StackedLayers | None = None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], metadata: AttentionMetadata) -> torch.Tensor:
        positions = positions.to(torch.int64)
        if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < (
                self.rotary.max_positions):
            raise ValueError(f"positions must lie in 0..{self.rotary.max_positions - 1}")
        k_cache = kv_caches[0][0]
        # Checked whole, then cut: each part's indices stay inside the checked ones.
        plan = cpu_attention.plan_step(metadata.block_tables, metadata.context_lens,
                                       metadata.query_start_loc, metadata.slot_mapping,
                                       num_tokens=len(token_ids), num_blocks=k_cache.shape[0],
                                       block_size=k_cache.shape[1], max_runs=self.num_parts)
        is_compiled = bool(self.sgemm_address) and self.stacked is not None and (
            self.stacked.holds(kv_caches))
        forward_part = self._forward_part_compiled if is_compiled else self._forward_part_in_ops
        parts = split_step(plan.context_lens, plan.query_start_loc, self.num_parts,
                           MIN_TOKENS_PER_COMPILED_PART if is_compiled else None)
        if len(parts) == 1 or reads_another_parts_writes(plan, parts, k_cache.shape[0],
                                                         k_cache.shape[1]):
            return forward_part(token_ids, positions, kv_caches, plan)
        helpers = [_helper_pool(len(parts) - 1).submit(
            forward_part, token_ids[part.first_token:part.end_token],
            positions[part.first_token:part.end_token], kv_caches, plan.part(part))
            for part in parts[1:]]
        first = parts[0]
        hidden = [forward_part(token_ids[first.first_token:first.end_token],
                               positions[first.first_token:first.end_token], kv_caches,
                               plan.part(first))]
        return torch.cat(hidden + [helper.result() for helper in helpers])

    def _forward_part_compiled(self, token_ids: torch.Tensor, positions: torch.Tensor,
                               kv_caches: list[KVCache],
                               plan: cpu_attention.StepPlan) -> torch.Tensor:
        """The part in one call of ``_forward_layers``, which holds no GIL: the other
        parts' threads and the trio thread run meanwhile."""
        stacked = cast(StackedLayers, self.stacked)  # holds(kv_caches): forward checked
        num_tokens = len(token_ids)
        if num_tokens and not 0 <= int(token_ids.min()) <= int(token_ids.max()) < len(
                self.embed_tokens):
            raise ValueError(f"token ids must lie in 0..{len(self.embed_tokens) - 1}")
        num_rows = -(-num_tokens // ROWS_PER_CHUNK) * ROWS_PER_CHUNK
        padded_ids, padded_positions = np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64)
        padded_slots = np.full(num_rows, -1, np.int64)
        padded_ids[:num_tokens] = token_ids.numpy()
        padded_positions[:num_tokens] = positions.numpy()
        padded_slots[:num_tokens] = cast(torch.Tensor, plan.slot_mapping).numpy()
        out = np.empty((num_rows, self.config.hidden_size), dtype=np.float32)
        attention = self.decoder_layers[0].self_attn
        _forward_layers(self.sgemm_address, padded_ids, self.embed_tokens.numpy(),
                        padded_positions, padded_slots, self.rotary.cos.numpy(),
                        self.rotary.sin.numpy(), plan.block_tables, plan.context_lens,
                        plan.query_start_loc, kv_caches[0][0].shape[1],
                        np.float32(attention.scale), stacked.norms, stacked.weights,
                        stacked.biases, stacked.has_biases, stacked.k_rows, stacked.v_rows,
                        attention.q_norm is not None and attention.k_norm is not None,
                        np.float32(self.norm.eps), self.config.num_heads,
                        self.config.num_kv_heads, out)
        return torch.from_numpy(out[:num_tokens])

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        """CausalLM's caches, every layer's keys (and values) views of one tensor, which
        the compiled forward takes whole."""
        if not self.sgemm_address:
            return super().allocate_kv_caches(num_blocks, block_size)
        config = self.config
        caches = torch.empty(2, config.num_layers, num_blocks, block_size,
                             self.num_local_kv_heads, config.head_dim, dtype=self.dtype)
        assert self.stacked is not None
        self.stacked.caches = caches
        return [(caches[0, layer], caches[1, layer]) for layer in range(config.num_layers)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """CausalLM's logits, bit for bit: the lm_head's GEMM chunks, spread over up to
        ``num_parts`` threads in whole chunks, none holding the GIL."""
        if not self.sgemm_address:
            return super().compute_logits(hidden)
        num_rows = hidden.shape[0]
        num_chunks = -(-num_rows // ROWS_PER_CHUNK)
        rows = np.zeros((num_chunks * ROWS_PER_CHUNK, hidden.shape[1]), dtype=np.float32)
        rows[:num_rows] = hidden.numpy()
        logits = np.empty((len(rows), self.lm_head.weight.shape[0]), dtype=np.float32)
        weight = self.lm_head.weight.numpy()
        num_threads = max(1, min(self.num_parts, num_chunks))
        bounds = [ROWS_PER_CHUNK * (num_chunks * index // num_threads)
                  for index in range(num_threads + 1)]

        def run(first: int, end: int) -> None:
            _linear_chunks(self.sgemm_address, rows[first:end], weight, logits[first:end])

        helpers = [_helper_pool(num_threads - 1).submit(run, first, end)
                   for first, end in zip(bounds[1:-1], bounds[2:], strict=True)]
        run(bounds[0], bounds[1])
        for helper in helpers:
            helper.result()
        return torch.from_numpy(logits[:num_rows])

    def _forward_part_in_ops(self, token_ids: torch.Tensor, positions: torch.Tensor,
                             kv_caches: list[KVCache],
                             plan: cpu_attention.StepPlan) -> torch.Tensor:
        """The part in torch operations and one kernel call per fused op."""
        return self.fused_forward(CPU_OPS, token_ids, positions, kv_caches, plan)


_helper_pools: dict[int, ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()


def _helper_pool(num_threads: int) -> ThreadPoolExecutor:
    """A pool of ``num_threads`` threads for a step's parts, made on first use and kept."""
    with _pool_lock:
        if num_threads not in _helper_pools:
            _helper_pools[num_threads] = ThreadPoolExecutor(
                max_workers=num_threads, thread_name_prefix="cpu-forward")
        return _helper_pools[num_threads]


def fuse_model(model: CausalLM, num_parts: int = 1) -> CausalLM:
    """Run ``model`` through the fused CPU kernels, in place, where ``can_fuse``, a step in
    up to ``num_parts`` parts on as many threads; returns it. Its weights, cache layout
    and row-chunked linear layers stay as they were."""
    if can_fuse(model):
        model.__class__ = CpuFusedCausalLM
        fused = cast(CpuFusedCausalLM, model)
        fused.num_parts = num_parts
        fused.sgemm_address = sgemm_address() if can_compile_forward(model) else 0
        if fused.sgemm_address:
            fused.stacked = StackedLayers(fused)
            _compile_forward(fused)
    return model


def _compile_forward(model: CpuFusedCausalLM) -> None:
    """Compile (or load from numba's disk cache) the compiled forward for this model's
    argument types with a step of one token on a cache of one slot: seconds better spent
    at start-up than in the first step."""
    caches = model.allocate_kv_caches(1, 1)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        block_tables=torch.zeros(1, 1, dtype=torch.int32),
        context_lens=torch.ones(1, dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
    token_ids = torch.zeros(1, dtype=torch.int64)
    with torch.inference_mode():
        model.compute_logits(model(token_ids, token_ids, caches, metadata))


def can_compile_forward(model: CausalLM) -> bool:
    """The compiled forward takes a dense model (every feed-forward an MLP) with layers."""
    return model.config.num_layers > 0 and all(
        type(layer.mlp) is MLP for layer in model.decoder_layers)


