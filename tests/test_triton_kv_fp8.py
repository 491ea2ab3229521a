"""The Triton kernels over an FP8 KV cache (e4m3 with per-layer scales) against the torch
reference: the cache writes (plain and fused with the norms and rotation) store the bits
the reference stores, and decode and varlen attention read them back as the reference
does. In Triton's interpreter on the CPU (float32 queries), compiled on CUDA (bf16).
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from test_triton_attention import random_batch, relative_error  # noqa: E402

from trio_llm.gpu.attention import paged_attention, write_kv_cache  # noqa: E402
from trio_llm.gpu.kernels import triton_attention, triton_layers  # noqa: E402
from trio_llm.gpu.layers.rotary import RotaryEmbedding  # noqa: E402
from trio_llm.gpu.models.config import RopeConfig  # noqa: E402
from trio_llm.gpu.quantization import E4M3, KVScales, quantize_kv  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
# The kernels and the reference read the same e4m3 values: what differs is the order of
# float32 sums (and bf16 operands on CUDA).
TOLERANCE = 2e-2 if HAS_CUDA else 1e-5
SCALES = [KVScales(), KVScales(0.25, 4.0)]
# Triton 3.7's interpreter rounds float32 to e4m3 without the carry: a value whose
# mantissa rounds up past its binade (7.9 -> 8) lands a binade low (4). The GPU's
# conversion rounds to nearest even, as torch does. In the interpreter the writes are
# checked on values e4m3 holds exactly (times power-of-two scales: no rounding at all),
# and the fused kernel, which rounds rotated keys, on the share of values it stores alike.
EXACT_INPUTS = not HAS_CUDA


def as_fp8_cache(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return quantize_kv(cache, scale, E4M3)


@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
def test_the_write_kernel_stores_the_references_bits(scales):
    generator = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 32, generator=generator) * 4
    value = torch.randn(6, 2, 32, generator=generator)
    if EXACT_INPUTS:
        key = quantize_kv(key, scales.k_scale, E4M3).to(torch.float32) * scales.k_scale
        value = quantize_kv(value, scales.v_scale, E4M3).to(torch.float32) * scales.v_scale
    key, value = key.to(DTYPE).to(DEVICE), value.to(DTYPE).to(DEVICE)
    key[0, 0, 0] = 5000.0  # saturates
    slots = torch.tensor([3, 0, -1, 7, 12, 15], device=DEVICE)
    ours = [torch.zeros(2, 8, 2, 32, dtype=E4M3, device=DEVICE) for _ in range(2)]
    theirs = [torch.zeros_like(cache) for cache in ours]
    triton_attention.write_kv_cache(key, value, *ours, slots, k_scale=scales.k_scale,
                                    v_scale=scales.v_scale)
    write_kv_cache(key, value, *theirs, slots, k_scale=scales.k_scale, v_scale=scales.v_scale)
    for our_cache, their_cache in zip(ours, theirs, strict=True):
        assert torch.equal(our_cache.view(torch.uint8), their_cache.view(torch.uint8))
    assert ours[0].flatten(0, 1)[3, 0, 0].to(torch.float32).item() == 448.0


def _fp8_batch(generator, scales: KVScales, **shape):
    query, k_cache, v_cache, *layout = random_batch(generator, **shape)
    return (query, as_fp8_cache(k_cache * 2, scales.k_scale),
            as_fp8_cache(v_cache, scales.v_scale), *layout)


def _reference(batch, scale: float, scales: KVScales) -> torch.Tensor:
    query, k_cache, v_cache, *layout = batch
    return paged_attention(query.double(), k_cache, v_cache, *layout, scale,
                           k_scale=scales.k_scale, v_scale=scales.v_scale)


@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_over_an_fp8_cache_matches_the_reference(scales, num_splits):
    generator = torch.Generator().manual_seed(7 + num_splits)
    batch = _fp8_batch(generator, scales, query_lens=[1] * 4, context_lens=[1, 37, 130, 64],
                       num_heads=4, num_kv_heads=2, head_dim=32, block_size=16)
    scale = 32**-0.5
    out = triton_attention.paged_attention(*batch, scale, num_splits=num_splits,
                                           k_scale=scales.k_scale, v_scale=scales.v_scale)
    assert relative_error(out, _reference(batch, scale, scales)) < TOLERANCE


@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
def test_varlen_over_an_fp8_cache_matches_the_reference(scales):
    generator = torch.Generator().manual_seed(11)
    batch = _fp8_batch(generator, scales, query_lens=[20, 9, 1, 40],
                       context_lens=[20, 41, 33, 40], num_heads=6, num_kv_heads=2,
                       head_dim=16, block_size=8)
    scale = 16**-0.5
    varlen = triton_attention.VarlenConfig(block_m=16, block_n=16)
    out = triton_attention.paged_attention(*batch, scale, varlen=varlen,
                                           k_scale=scales.k_scale, v_scale=scales.v_scale)
    expected = _reference(batch, scale, scales)
    assert relative_error(out, expected) < TOLERANCE
    # the scales matter: read back unscaled, the output is another one
    if scales != KVScales():
        unscaled = triton_attention.paged_attention(*batch, scale, varlen=varlen)
        assert relative_error(unscaled, expected) > 0.1


def test_an_fp8_cache_at_a_head_dim_below_its_tile_matches_the_reference():
    """head_dim 24 takes a 32-wide tile: the e4m3 tiles, read two values a 16-bit word,
    mask the words past the head (decode and varlen, whole and partial tiles)."""
    scales = KVScales(0.25, 4.0)
    generator = torch.Generator().manual_seed(5)
    scale = 24**-0.5
    for query_lens in ([1] * 4, [1, 9, 30, 2]):
        batch = _fp8_batch(generator, scales, query_lens=query_lens,
                           context_lens=[1, 37, 130, 64], num_heads=4, num_kv_heads=2,
                           head_dim=24, block_size=16)
        out = triton_attention.paged_attention(
            *batch, scale, num_splits=2, k_scale=scales.k_scale, v_scale=scales.v_scale,
            varlen=triton_attention.VarlenConfig(16, 16, 4, 2))
        assert relative_error(out, _reference(batch, scale, scales)) < TOLERANCE


@pytest.mark.parametrize("num_splits", [1, 3])
def test_a_bf16_query_meets_an_fp8_cache_in_float16(num_splits):
    """A bf16 query (the CUDA models') over an FP8 cache multiplies in float16 (e4m3
    widens to it in one conversion a pair of values): decode and varlen within a bf16
    rounding of the reference, and a query past float16's range is clamped to it, so
    its scores stay finite (no inf, no NaN from inf - inf in the softmax)."""
    scales = KVScales(0.25, 4.0)
    generator = torch.Generator().manual_seed(3 + num_splits)
    shape = dict(context_lens=[1, 37, 130, 64], num_heads=4, num_kv_heads=2, head_dim=32,
                 block_size=16)
    for query_lens in ([1] * 4, [1, 9, 30, 2]):
        batch = _fp8_batch(generator, scales, query_lens=query_lens, **shape)
        query = batch[0].to(torch.bfloat16)
        scale = 32**-0.5
        out = triton_attention.paged_attention(
            query, *batch[1:], scale, num_splits=num_splits, k_scale=scales.k_scale,
            v_scale=scales.v_scale, varlen=triton_attention.VarlenConfig(16, 16, 4, 2))
        assert out.dtype == torch.bfloat16
        expected = _reference((query, *batch[1:]), scale, scales)
        assert relative_error(out.to(torch.float64), expected) < 2e-2
        huge = query.clone()
        huge[:, 0] *= 1e6  # past float16's 65504
        out = triton_attention.paged_attention(
            huge, *batch[1:], scale, num_splits=num_splits, k_scale=scales.k_scale,
            v_scale=scales.v_scale, varlen=triton_attention.VarlenConfig(16, 16, 4, 2))
        assert torch.isfinite(out.to(torch.float32)).all()


@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
def test_the_fused_norm_rope_write_stores_what_the_reference_writer_would(scales):
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 16, 6
    generator = torch.Generator().manual_seed(3)
    rotary = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0), device=DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=generator) * 3
    if EXACT_INPUTS:  # values e4m3 holds exactly after their scale (keys are rotated)
        qkv = quantize_kv(qkv, scales.v_scale, E4M3).to(torch.float32) * scales.v_scale
    qkv = qkv.to(DTYPE).to(DEVICE)
    positions = torch.tensor([0, 5, 9, 63, 1, 2], device=DEVICE)
    slot_mapping = torch.tensor([3, 0, -1, 7, 12, 15], device=DEVICE)
    k_cache = torch.zeros(2, 8, num_kv_heads, head_dim, dtype=E4M3, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    triton_layers.qk_norm_rope_write_kv(
        qkv, positions, rotary.cos, rotary.sin, None, None, 1e-6, k_cache, v_cache,
        slot_mapping, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        kv_scales=scales)

    _, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                               num_kv_heads * head_dim], dim=-1)
    query = torch.zeros(num_tokens, num_heads, head_dim, dtype=DTYPE, device=DEVICE)
    _, key = rotary(positions, query, key.reshape(num_tokens, num_kv_heads, head_dim))
    expected = [torch.zeros_like(k_cache) for _ in range(2)]
    write_kv_cache(key, value.reshape(num_tokens, num_kv_heads, head_dim), *expected,
                   slot_mapping, k_scale=scales.k_scale, v_scale=scales.v_scale)
    assert torch.equal(v_cache.view(torch.uint8), expected[1].view(torch.uint8))
    written = slot_mapping[slot_mapping >= 0]
    ours = k_cache.flatten(0, 1)[written].to(torch.float32)
    theirs = expected[0].flatten(0, 1)[written].to(torch.float32)
    # the kernel rounds the rotated float32 key to e4m3 once; the torch layers round it to
    # the activation dtype first: at most one e4m3 step apart (2^-3 relative)
    if HAS_CUDA:
        assert ((ours - theirs).abs() <= theirs.abs() * 2**-3 + 2**-9).all()
    assert (ours == theirs).float().mean().item() > 0.8
