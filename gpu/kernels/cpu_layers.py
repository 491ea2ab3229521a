"""Fused numba kernels for the decoder's small operations (the CPU path, float32).

Plain torch spends some thirty operations per layer on norms, rotary embeddings,
activations and the store of keys and values: at decode sizes each costs more in
dispatch than in arithmetic, and at prefill sizes each is one more pass over
memory. These kernels do the same in four calls, as gpu/kernels/triton_layers.py does
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
order (gpu/kernels/cpu_attention.py); each elementwise step rounds where the torch model
rounds, so the fused model computes the torch model's function up to the order
of those sums and the exponential in SiLU (the attention kernel's).

gpu/models/cpu_fused.py hands them to a model's fused forward.
The dense family's compiled forward goes further: ``_forward_layers`` runs a
part of a step's whole forward as one compiled call, the linear layers through
torch's own ``sgemm_`` (gpu/kernels/cpu_blas.py) in the chunks ``chunked_linear``
uses, so the bits are those of the same model in torch operations, and no GIL
is held while it runs.
"""

from __future__ import annotations

import threading
from typing import Any

import numba
import numpy as np
import torch

from trio_llm.gpu.kernels.cpu_attention import LANES, _attend_rows, _exp_nonpositive, _lane_sum
from trio_llm.gpu.kernels.cpu_blas import ROWS_PER_CHUNK, _gemm

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
    chunks): chunked_linear's shapes and bits (gpu/kernels/cpu_blas.py)."""
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
    """The dense decoder's whole forward over one part of a step, as CpuFusedCausalLM's
    torch operations compute it, op for op and bit for bit: every row of ``token_ids`` (a whole
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
