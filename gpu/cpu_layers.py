"""Fused numba kernels for the decoder's small operations (the CPU path, float32).

Plain torch spends some thirty operations per layer on norms, rotary embeddings,
activations and the store of keys and values: at decode sizes each costs more in
dispatch than in arithmetic, and at prefill sizes each is one more pass over
memory. These kernels do the same in four calls, as gpu/triton_layers.py does
on CUDA:

- ``rms_norm`` and ``add_rms_norm`` (the residual add, then RMSNorm);
- ``qk_norm_rope_write_kv``: Qwen3's q/k RMSNorm, the rotary embedding, and the
  store of keys and values into the paged cache, straight from the fused qkv
  projection's output;
- ``silu_and_mul``: SwiGLU.

Every kernel works row by row, in an order that depends on the row's length
only, compiled without fast-math flags (no reassociation, no fused multiply-add):
a row's result never depends on the other rows of the step, so the fused model
stays batch-invariant. Sums of squares take the attention kernel's fixed lane
order (gpu/cpu_attention.py); each elementwise step rounds where the torch model
rounds, so the fused model computes the torch model's function up to the order
of those sums and the exponential in SiLU (the attention kernel's).

``fuse_model(model)`` makes a loaded float32 CausalLM on the CPU run its forward
through these kernels and the CPU attention kernel, keeping its weights; the
layout checks of the attention kernel then run once per step, not once per layer.
The compiled forward goes further: each part of a step runs its whole forward
as one compiled call, ``_forward_layers``, the linear layers through torch's own
``sgemm_`` (gpu/cpu_blas.py) in the chunks ``chunked_linear`` uses, so the bits are
those of the same model in torch operations, and no GIL is held while it runs.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numba
import numpy as np
import torch
import torch.nn.functional as F

from trio_llm.gpu import cpu_attention
from trio_llm.gpu.cpu_attention import LANES, _attend_rows, _exp_nonpositive, _lane_sum
from trio_llm.gpu.cpu_blas import ROWS_PER_CHUNK, _gemm, sgemm_address
from trio_llm.gpu.model import AttentionMetadata, CausalLM, DecoderLayer, KVCache

_kernel = numba.njit(boundscheck=False, error_model="numpy", cache=True, nogil=True)
_inlined_kernel = numba.njit(boundscheck=False, error_model="numpy", cache=True, nogil=True,
                             inline="always")


@_inlined_kernel
def _normalize_row(source: np.ndarray, source_start: int, length: int, weight: np.ndarray,
                   eps: np.float32, out: np.ndarray, out_start: int) -> None:  # pragma: no cover
    """``out[out_start:][:length]``: RMSNorm of ``source[source_start:][:length]`` (1D)."""
    squares = _lane_sum(source, source_start, source, source_start, length)
    inverse_root = np.float32(1.0) / np.sqrt(squares / np.float32(length) + eps)
    for index in range(length):
        out[out_start + index] = weight[index] * (source[source_start + index] * inverse_root)


@_kernel
def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32,
              out: np.ndarray) -> None:  # pragma: no cover
    """``x``/``out`` [num_rows, hidden], contiguous."""
    hidden = x.shape[1]
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for row in range(x.shape[0]):
        _normalize_row(x_flat, row * hidden, hidden, weight, eps, out_flat, row * hidden)


@_kernel
def _add_rms_norm(x: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: np.float32,
                  out: np.ndarray, residual_out: np.ndarray) -> None:  # pragma: no cover
    """``residual_out = residual + x``, then ``out`` its RMSNorm; all [num_rows, hidden]."""
    hidden = x.shape[1]
    sum_flat, out_flat = residual_out.reshape(-1), out.reshape(-1)
    for row in range(x.shape[0]):
        for index in range(hidden):
            residual_out[row, index] = residual[row, index] + x[row, index]
        _normalize_row(sum_flat, row * hidden, hidden, weight, eps, out_flat, row * hidden)


@_kernel
def _qk_norm_rope_write_kv(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray,
                           sin: np.ndarray, q_weight: np.ndarray, k_weight: np.ndarray,
                           has_qk_norm: bool, eps: np.float32, slot_mapping: np.ndarray,
                           k_rows: np.ndarray, v_rows: np.ndarray, num_heads: int,
                           num_kv_heads: int, query: np.ndarray) -> None:  # pragma: no cover
    """``qkv`` [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; ``query``
    [num_tokens * num_heads, head_dim]; ``k_rows``/``v_rows`` the caches as one row per
    (slot, KV head). A negative slot is not written."""
    head_dim = query.shape[1]
    half = head_dim // 2
    qkv_flat = qkv.reshape(-1)
    normed = np.empty(head_dim, dtype=np.float32)
    for token in range(qkv.shape[0]):
        position, slot = positions[token], slot_mapping[token]
        row_start = token * qkv.shape[1]
        for head in range(num_heads + num_kv_heads):
            is_query = head < num_heads
            if not is_query and slot < 0:
                continue
            head_start = row_start + head * head_dim
            if has_qk_norm:
                _normalize_row(qkv_flat, head_start, head_dim,
                               q_weight if is_query else k_weight, eps, normed, 0)
            else:
                normed[:] = qkv_flat[head_start:head_start + head_dim]
            out = (query[token * num_heads + head] if is_query
                   else k_rows[slot * num_kv_heads + head - num_heads])
            # x * cos + rotate_half(x) * sin, rotate_half(x) = (-second half, first half)
            for index in range(half):
                first, second = normed[index], normed[index + half]
                out[index] = first * cos[position, index] + -second * sin[position, index]
                out[index + half] = (second * cos[position, index + half]
                                     + first * sin[position, index + half])
        if slot >= 0:
            values_start = row_start + (num_heads + num_kv_heads) * head_dim
            for kv_head in range(num_kv_heads):
                for index in range(head_dim):
                    v_rows[slot * num_kv_heads + kv_head, index] = qkv_flat[
                        values_start + kv_head * head_dim + index]


@_kernel
def _silu_and_mul(gate_up: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """``out = silu(gate) * up``, ``gate``/``up`` the halves of each row of ``gate_up``.

    silu(g) = g / (1 + exp(-g)), written with exp(-|g|) so that the exponential's
    argument is never positive: for g < 0 it is g exp(g) / (exp(g) + 1)."""
    size = out.shape[1]
    for row in range(gate_up.shape[0]):
        for index in range(size):
            gate = gate_up[row, index]
            decay = _exp_nonpositive(-abs(gate))
            numerator = gate if gate >= np.float32(0.0) else gate * decay
            out[row, index] = numerator / (np.float32(1.0) + decay) * gate_up[row, size + index]


@_kernel
def _linear_chunks(address: int, x: np.ndarray, weight: np.ndarray,
                   out: np.ndarray) -> None:  # pragma: no cover
    """``out = x weight^T``, one GEMM per ROWS_PER_CHUNK rows (``x`` a whole number of
    chunks): chunked_linear's shapes and bits (gpu/cpu_blas.py)."""
    num_in, num_out = x.shape[1], weight.shape[0]
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for first_row in range(0, x.shape[0], ROWS_PER_CHUNK):
        _gemm(address, num_out, ROWS_PER_CHUNK, num_in, weight, 0, x_flat,
              first_row * num_in, np.float32(0.0), out_flat, first_row * num_out)


@_kernel
def _biased_linear_chunks(address: int, x: np.ndarray, weight: np.ndarray, bias: np.ndarray,
                          has_bias: bool, out: np.ndarray) -> None:  # pragma: no cover
    """``_linear_chunks`` plus ``bias`` where ``has_bias``, as ``torch.baddbmm`` adds it
    in chunked_linear: every row of ``out`` starts as the bias, the GEMM adds to it."""
    if not has_bias:
        _linear_chunks(address, x, weight, out)
        return
    num_in, num_out = x.shape[1], weight.shape[0]
    x_flat, out_flat = x.reshape(-1), out.reshape(-1)
    for row in range(out.shape[0]):
        out[row] = bias
    for first_row in range(0, x.shape[0], ROWS_PER_CHUNK):
        _gemm(address, num_out, ROWS_PER_CHUNK, num_in, weight, 0, x_flat,
              first_row * num_in, np.float32(1.0), out_flat, first_row * num_out)


@_kernel
def _forward_layers(address: int, token_ids: np.ndarray, embed: np.ndarray,
                    positions: np.ndarray, slot_mapping: np.ndarray, cos: np.ndarray,
                    sin: np.ndarray, block_tables: np.ndarray, context_lens: np.ndarray,
                    query_start_loc: np.ndarray, block_size: int, scale: np.float32,
                    norms: Any, weights: Any, biases: Any, has_biases: np.ndarray,
                    k_caches: Any, v_caches: Any,
                    has_qk_norm: bool, eps: np.float32, num_heads: int, num_kv_heads: int,
                    out: np.ndarray) -> None:  # pragma: no cover
    """The decoder's whole forward over one part of a step, as CpuFusedCausalLM's torch
    operations compute it, op for op and bit for bit: every row of ``token_ids`` (a whole
    number of GEMM chunks; rows past the sequences have position 0 and slot -1) to its
    final norm in ``out``. ``norms`` (input, post-attention, q, k: [layer, size]; final)
    and ``weights`` (qkv, o, gate_up, down: [layer, out, in]) hold every layer's arrays
    stacked, ``biases`` theirs ([layer, out]; read where ``has_biases``, per kind); the
    caches [layer, slot * KV head, head_dim]."""
    num_rows, hidden_size = token_ids.shape[0], embed.shape[1]
    input_norms, post_norms, q_norms, k_norms, final_norm = norms
    qkv_weights, o_weights, gate_up_weights, down_weights = weights
    qkv_biases, o_biases, gate_up_biases, down_biases = biases
    head_dim = k_caches.shape[2]
    residual = np.empty((num_rows, hidden_size), dtype=np.float32)
    normed = np.empty_like(residual)
    hidden = np.empty_like(residual)
    qkv = np.empty((num_rows, qkv_weights.shape[1]), dtype=np.float32)
    query = np.empty((num_rows * num_heads, head_dim), dtype=np.float32)
    # rows of no sequence read as zeros, as attend() leaves them
    attended = np.zeros((num_rows * num_heads, head_dim), dtype=np.float32)
    gate_up = np.empty((num_rows, gate_up_weights.shape[1]), dtype=np.float32)
    activated = np.empty((num_rows, gate_up.shape[1] // 2), dtype=np.float32)
    for row in range(num_rows):
        residual[row] = embed[token_ids[row]]
    for layer in range(qkv_weights.shape[0]):
        if layer == 0:
            _rms_norm(residual, input_norms[0], eps, normed)
        else:
            _add_rms_norm(hidden, residual, input_norms[layer], eps, normed, residual)
        _biased_linear_chunks(address, normed, qkv_weights[layer], qkv_biases[layer],
                              has_biases[0], qkv)
        _qk_norm_rope_write_kv(qkv, positions, cos, sin, q_norms[layer], k_norms[layer],
                               has_qk_norm, eps, slot_mapping, k_caches[layer],
                               v_caches[layer], num_heads, num_kv_heads, query)
        _attend_rows(query, k_caches[layer], v_caches[layer], block_tables, context_lens,
                     query_start_loc, block_size, num_heads, num_kv_heads, scale, attended)
        _biased_linear_chunks(address, attended.reshape(num_rows, num_heads * head_dim),
                              o_weights[layer], o_biases[layer], has_biases[1], hidden)
        _add_rms_norm(hidden, residual, post_norms[layer], eps, normed, residual)
        _biased_linear_chunks(address, normed, gate_up_weights[layer],
                              gate_up_biases[layer], has_biases[2], gate_up)
        _silu_and_mul(gate_up, activated)
        _biased_linear_chunks(address, activated, down_weights[layer], down_biases[layer],
                              has_biases[3], hidden)
    _add_rms_norm(hidden, residual, final_norm, eps, out, residual)


# -- torch-facing wrappers ---------------------------------------------------------------


def _rows(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous float32 tensor as a 2D array [rows, last dimension]."""
    return tensor.view(-1, tensor.shape[-1]).numpy()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of a contiguous float32 ``x``."""
    out = torch.empty_like(x)
    _rms_norm(_rows(x), weight.numpy(), np.float32(eps), _rows(out))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of ``residual + x``, ``residual + x``)."""
    out, residual_out = torch.empty_like(x), torch.empty_like(x)
    _add_rms_norm(_rows(x), _rows(residual), weight.numpy(), np.float32(eps), _rows(out),
                  _rows(residual_out))
    return out, residual_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: the first half of each row gates the second half."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _silu_and_mul(gate_up.numpy(), out.numpy())
    return out


def qk_norm_rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, q_norm: torch.Tensor | None,
                          k_norm: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                          num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """From the fused qkv output [num_tokens, (heads + 2 kv_heads) * head_dim]: normed,
    rotated queries [num_tokens, num_heads, head_dim]; keys and values go to the cache.
    ``positions`` and ``slot_mapping`` int64, checked by the caller (``StepPlan``)."""
    head_dim = k_cache.shape[-1]
    query = qkv.new_empty(qkv.shape[0], num_heads, head_dim)
    has_qk_norm = q_norm is not None and k_norm is not None
    q_weight = q_norm.numpy() if q_norm is not None else _NO_WEIGHT
    k_weight = k_norm.numpy() if k_norm is not None else _NO_WEIGHT
    _qk_norm_rope_write_kv(qkv.numpy(), positions.numpy(), cos.numpy(), sin.numpy(), q_weight,
                           k_weight, has_qk_norm, np.float32(eps), slot_mapping.numpy(),
                           k_cache.view(-1, head_dim).numpy(),
                           v_cache.view(-1, head_dim).numpy(), num_heads, num_kv_heads,
                           query.view(-1, head_dim).numpy())
    return query


_NO_WEIGHT = np.zeros(1, dtype=np.float32)


# -- the fused model ---------------------------------------------------------------------


def can_fuse(model: CausalLM) -> bool:
    """The kernels take float32 on the CPU, rows a whole number of lanes and even heads;
    the fused forward has no collectives, so a tensor-parallel shard runs unfused."""
    config = model.config
    return (model.device.type == "cpu" and model.dtype == torch.float32
            and not model.parallel.is_parallel
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
        layers = cast(list[DecoderLayer], list(model.layers))

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
                 [layer.mlp.gate_up_proj for layer in layers],
                 [layer.mlp.down_proj for layer in layers])
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
    # torch's sgemm_ (gpu/cpu_blas.py): a part runs in one compiled call; 0: in torch ops
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
        attention = cast(DecoderLayer, self.layers[0]).self_attn
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
        hidden = F.embedding(token_ids, self.embed_tokens)
        residual: torch.Tensor | None = None
        # nn.ModuleList yields Modules; its items are DecoderLayers (CausalLM builds them).
        layers = cast(list[DecoderLayer], list(self.layers))
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            norm = layer.input_layernorm
            if residual is None:
                residual = hidden
                normed = rms_norm(hidden, norm.weight, norm.eps)
            else:
                normed, residual = add_rms_norm(hidden, residual, norm.weight, norm.eps)
            hidden = self._attention(layer, normed, positions, kv_cache, plan)
            norm = layer.post_attention_layernorm
            normed, residual = add_rms_norm(hidden, residual, norm.weight, norm.eps)
            mlp = layer.mlp
            hidden = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(normed)))
        if residual is None:
            return rms_norm(hidden, self.norm.weight, self.norm.eps)
        return add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def _attention(self, layer: DecoderLayer, hidden: torch.Tensor, positions: torch.Tensor,
                   kv_cache: KVCache, plan: cpu_attention.StepPlan) -> torch.Tensor:
        attention = layer.self_attn
        k_cache, v_cache = kv_cache
        q_norm, k_norm = attention.q_norm, attention.k_norm
        query = qk_norm_rope_write_kv(
            attention.qkv_proj(hidden), positions, self.rotary.cos, self.rotary.sin,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0, k_cache, v_cache,
            cast(torch.Tensor, plan.slot_mapping),
            num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads)
        attended = cpu_attention.attend(plan, query, k_cache, v_cache, attention.scale)
        return attention.o_proj(attended.view(hidden.shape[0], attention.q_size))


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
    """The compiled forward takes a model with layers."""
    return model.config.num_layers > 0


_warm_lock = threading.Lock()


def warm_up() -> None:
    """Compile (or load from numba's disk cache) every kernel, once, before any step."""
    with _warm_lock:
        if _silu_and_mul.signatures:
            return
        rows = torch.zeros(1, LANES)
        rms_norm(rows, torch.ones(LANES), 1e-6)
        add_rms_norm(rows, rows, torch.ones(LANES), 1e-6)
        silu_and_mul(torch.zeros(1, 2 * LANES))
        cache = torch.zeros(1, 1, 1, LANES)
        for weight in (torch.ones(LANES), None):
            qk_norm_rope_write_kv(torch.zeros(1, 3 * LANES), torch.zeros(1, dtype=torch.int64),
                                  torch.ones(1, LANES), torch.zeros(1, LANES), weight, weight,
                                  1e-6, cache, cache.clone(),
                                  torch.zeros(1, dtype=torch.int64), num_heads=1,
                                  num_kv_heads=1)
