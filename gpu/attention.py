"""Attention over the paged KV cache: the torch reference, and the backend hook.

Layout (the contract every backend implements, Triton kernels included):

- ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
- a slot is ``block_id * block_size + offset``; a negative slot is padding and
  is not written;
- ``query`` holds the tokens of every sequence, concatenated; sequence ``s``
  owns rows ``query_start_loc[s]:query_start_loc[s + 1]``;
- ``context_lens[s]`` counts the tokens in the cache for sequence ``s``,
  this step's included: query ``i`` of a sequence with ``q`` queries sits at
  position ``context_len - q + i`` and attends to every position up to its own;
- grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

- an FP8 cache (``torch.float8_e4m3fn``, ``--kv-cache-dtype fp8``) holds
  ``key / k_scale`` and ``value / v_scale``: the writer divides, the reader
  multiplies back (gpu/quantization.py); any other cache holds the values and
  ``k_scale = v_scale = 1``.

The reference gathers each sequence's keys and values through its block table
and runs plain attention on them. It works on any device, and it is what fast
kernels are checked against.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trio_llm.gpu.quantization import quantize_kv

# Long prefills are split into query tiles whose score matrix stays under this size.
SCORES_BUDGET_BYTES = 256 * 2**20


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Store ``key``/``value`` [num_tokens, num_kv_heads, head_dim] at their slots (in an
    FP8 cache: divided by their scales)."""
    is_real = slot_mapping >= 0
    slots = slot_mapping[is_real]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(key[is_real], k_scale,
                                                                  k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = quantize_kv(value[is_real], v_scale,
                                                                  v_cache.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of ``query`` over the paged cache -> [num_tokens, num_heads, head_dim].

    Computes in float32 (or the inputs' dtype if wider).
    """
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    return _paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                            query_start_loc, scale, compute_dtype, (k_scale, v_scale))


def float64_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, *,
                            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The reference computed in float64 and rounded back: batch-invariant in practice.

    The softmax sums run over a context that grows with how a prompt is split
    into chunks, and a float32 sum changes with its length and blocking.
    In float64 those differences sit some 29 bits below float32's last bit, so
    they vanish in the rounding back except with probability ~1e-9 per value.
    """
    return _paged_attention(query, k_cache, v_cache, block_tables, context_lens,
                            query_start_loc, scale, torch.float64, (k_scale, v_scale))


def _paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     query_start_loc: torch.Tensor, scale: float,
                     compute_dtype: torch.dtype, kv_scales: tuple[float, float]
                     ) -> torch.Tensor:
    output = torch.zeros_like(query)
    # Converted once per call, not once per sequence: this loop runs per layer and step.
    wide_query = query.to(compute_dtype)
    block_tables = block_tables.to(torch.long)
    starts = query_start_loc.tolist()
    for seq_index, context_len in enumerate(context_lens.tolist()):
        start, end = starts[seq_index], starts[seq_index + 1]
        if end == start or context_len == 0:
            continue
        key, value = _gather_context(k_cache, v_cache, block_tables[seq_index], context_len)
        key, value = _dequantized(key, value, compute_dtype, kv_scales)
        num_queries = end - start
        tile_size = _query_tile_size(query.shape[1], context_len, compute_dtype)
        for tile_start in range(0, num_queries, tile_size):
            tile_end = min(tile_start + tile_size, num_queries)
            # The tile's last query sits at this context length: later keys are all masked.
            tile_context_len = context_len - (num_queries - tile_end)
            output[start + tile_start:start + tile_end] = _causal_attention(
                wide_query[start + tile_start:start + tile_end],
                key[:tile_context_len], value[:tile_context_len], scale,
            )
    return output


def _dequantized(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype,
                 kv_scales: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys and values in ``dtype``, times their scales (an FP8 cache's)."""
    key, value = key.to(dtype), value.to(dtype)
    k_scale, v_scale = kv_scales
    if k_scale != 1.0:
        key = key * k_scale
    if v_scale != 1.0:
        value = value * v_scale
    return key, value


def _query_tile_size(num_heads: int, context_len: int, dtype: torch.dtype) -> int:
    """Queries per tile so that one tile's attention scores fit SCORES_BUDGET_BYTES."""
    bytes_per_query = num_heads * context_len * dtype.itemsize
    return max(1, SCORES_BUDGET_BYTES // bytes_per_query)


def _gather_context(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's keys and values, in position order: [context_len, num_kv_heads, head_dim].

    ``block_table`` is an int64 row: indexing with it needs no conversion.
    """
    block_size = k_cache.shape[1]
    num_blocks = -(-context_len // block_size)
    block_ids = block_table[:num_blocks]
    key = k_cache[block_ids].flatten(0, 1)[:context_len]
    value = v_cache[block_ids].flatten(0, 1)[:context_len]
    return key, value


def _causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Queries are the last ``len(query)`` positions of the context ``key``/``value``."""
    num_queries, num_heads, head_dim = query.shape
    context_len, num_kv_heads, _ = key.shape
    group_size = num_heads // num_kv_heads
    # [num_kv_heads, group_size * num_queries, head_dim]: a query head's group shares a KV head.
    grouped = query.view(num_queries, num_kv_heads, group_size, head_dim)
    grouped = grouped.permute(1, 2, 0, 3).reshape(num_kv_heads, group_size * num_queries, head_dim)
    scores = torch.matmul(grouped, key.permute(1, 2, 0)) * scale
    if num_queries > 1:  # a lone query is the last position: it sees every key
        scores = _mask_future(scores, num_queries)
    weights = torch.softmax(scores, dim=-1)
    attended = torch.matmul(weights, value.permute(1, 0, 2))
    attended = attended.view(num_kv_heads, group_size, num_queries, head_dim)
    return attended.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_dim)


def _mask_future(scores: torch.Tensor, num_queries: int) -> torch.Tensor:
    """-inf where a query would see a key after its own position.

    ``scores`` is [num_kv_heads, group_size * num_queries, context_len], the queries
    being the context's last ``num_queries`` positions.
    """
    num_kv_heads, _, context_len = scores.shape
    query_positions = torch.arange(context_len - num_queries, context_len, device=scores.device)
    key_positions = torch.arange(context_len, device=scores.device)
    is_future = key_positions[None, :] > query_positions[:, None]
    scores = scores.view(num_kv_heads, -1, num_queries, context_len)
    return scores.masked_fill(is_future, float("-inf")).view(num_kv_heads, -1, context_len)


# -- backends ------------------------------------------------------------------------

WriteKVCache = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                        None]
PagedAttention = Callable[..., torch.Tensor]


def _nothing_to_warm_up() -> None:
    pass


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """A pair of functions with the signatures of this module's reference, and what to
    run once before serving so that the first step pays no compilation."""

    name: str
    write_kv_cache: WriteKVCache
    paged_attention: PagedAttention
    warm_up: Callable[[], None] = _nothing_to_warm_up


# Backends whose functions live in another module, imported on first use (Triton
# is only importable where CUDA is; the CPU kernel compiles with numba on first use).
LAZY_BACKEND_MODULES = {"triton": "trio_llm.gpu.kernels.triton_attention",
                        "cpu": "trio_llm.gpu.kernels.cpu_attention"}

ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "torch": AttentionBackend("torch", write_kv_cache, paged_attention),
    "float64": AttentionBackend("float64", write_kv_cache, float64_paged_attention),
}

# The backend a model gets by default, by device type, and the one it falls back to
# where that one cannot load. Both CPU choices are batch-invariant.
DEFAULT_BACKENDS = {"cpu": "cpu", "cuda": "triton"}
FALLBACK_BACKENDS = {"cpu": "float64"}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS and name in LAZY_BACKEND_MODULES:
        module = importlib.import_module(LAZY_BACKEND_MODULES[name])
        ATTENTION_BACKENDS[name] = AttentionBackend(
            name, module.write_kv_cache, module.paged_attention,
            getattr(module, "warm_up", _nothing_to_warm_up))
    if name not in ATTENTION_BACKENDS:
        known = sorted(set(ATTENTION_BACKENDS) | set(LAZY_BACKEND_MODULES))
        raise ValueError(f"unknown attention backend {name!r}; known: {', '.join(known)}")
    return ATTENTION_BACKENDS[name]


def default_attention_backend(device: torch.device) -> AttentionBackend:
    """The default backend for ``device``; its fallback (the torch reference unless
    named) where it cannot load."""
    name = DEFAULT_BACKENDS.get(device.type, "torch")
    try:
        return get_attention_backend(name)
    except ImportError:
        return get_attention_backend(FALLBACK_BACKENDS.get(device.type, "torch"))
