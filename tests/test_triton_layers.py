"""The fused Triton layer kernels against the torch model's own operations.

Interpreter mode on the CPU (float32, small shapes), compiled in bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu.builtin import resolve_model  # noqa: E402
from trio_llm.gpu.kernels import triton_layers  # noqa: E402
from trio_llm.gpu.layers.mlp import silu_and_mul as torch_silu_and_mul  # noqa: E402
from trio_llm.gpu.layers.norm import RMSNorm  # noqa: E402
from trio_llm.gpu.layers.rotary import RotaryEmbedding  # noqa: E402
from trio_llm.gpu.loader import fill_dummy_weights, load_model  # noqa: E402
from trio_llm.gpu.models import cuda_fused, parse_model_config  # noqa: E402
from trio_llm.gpu.models.base import AttentionMetadata, CausalLM  # noqa: E402
from trio_llm.gpu.models.config import RopeConfig  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32


def close(out, expected, tolerance=None):
    """Relative error under one bf16 rounding on CUDA, float32 sums otherwise."""
    tolerance = tolerance or (1e-2 if HAS_CUDA else 1e-5)
    error = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
    return error < tolerance


def random(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DTYPE).to(DEVICE)


def test_rms_norm_and_residual_add_match_the_model():
    norm = RMSNorm(96, eps=1e-6, dtype=DTYPE, device=DEVICE)
    norm.weight.data = random(96, seed=1)
    x, residual = random(5, 96, seed=2), random(5, 96, seed=3)
    assert close(triton_layers.rms_norm(x, norm.weight, norm.eps), norm(x))
    out, new_residual = triton_layers.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(new_residual, x + residual)
    assert close(out, norm(x + residual))


def test_silu_and_mul_matches_the_model():
    gate_up = random(3, 2 * 1500, seed=4)  # wider than one block
    assert close(triton_layers.silu_and_mul(gate_up), torch_silu_and_mul(gate_up))


@pytest.mark.parametrize("has_qk_norm", [True, False])
def test_qk_norm_rope_write_kv_matches_the_model(has_qk_norm):
    num_heads, num_kv_heads, head_dim, num_tokens = 4, 2, 16, 6
    rotary = RotaryEmbedding(head_dim, 64, RopeConfig(theta=10000.0), device=DEVICE)
    qkv = random(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=5)
    positions = torch.tensor([0, 5, 9, 63, 1, 2], device=DEVICE)
    slot_mapping = torch.tensor([3, 0, -1, 7, 12, 15], device=DEVICE)
    q_norm = RMSNorm(head_dim, eps=1e-6, dtype=DTYPE, device=DEVICE)
    k_norm = RMSNorm(head_dim, eps=1e-6, dtype=DTYPE, device=DEVICE)
    q_norm.weight.data, k_norm.weight.data = random(head_dim, seed=6), random(head_dim, seed=7)
    k_cache = torch.zeros(2, 8, num_kv_heads, head_dim, dtype=DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)

    query = triton_layers.qk_norm_rope_write_kv(
        qkv, positions, rotary.cos, rotary.sin, q_norm.weight if has_qk_norm else None,
        k_norm.weight if has_qk_norm else None, 1e-6, k_cache, v_cache, slot_mapping,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)

    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q, k = q.reshape(num_tokens, num_heads, head_dim), k.reshape(num_tokens, num_kv_heads, head_dim)
    if has_qk_norm:
        q, k = q_norm(q), k_norm(k)
    expected_query, expected_key = rotary(positions, q, k)
    assert close(query, expected_query)
    written = slot_mapping >= 0
    slots = slot_mapping[written]
    assert close(k_cache.flatten(0, 1)[slots], expected_key[written])
    assert torch.equal(v_cache.flatten(0, 1)[slots],
                       v.reshape(num_tokens, num_kv_heads, head_dim)[written])
    assert k_cache.flatten(0, 1)[2].abs().max().item() == 0.0  # slot -1 wrote nothing


def tiny_model() -> CausalLM:
    return load_model(resolve_model("tiny"), dtype=DTYPE, device=DEVICE)


def test_fused_model_matches_the_plain_model_on_a_mixed_batch():
    plain = tiny_model()
    fused = cuda_fused.fuse_model(tiny_model())
    assert type(fused).__name__ == "FusedCausalLM"
    # a 5-token prompt (blocks 0, 1) next to a decode token at position 3 (block 2)
    token_ids = torch.tensor([5, 17, 300, 2, 9, 44], device=DEVICE)
    positions = torch.tensor([0, 1, 2, 3, 4, 3], device=DEVICE)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1, 2, 3, 4, 11], device=DEVICE),
        block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([5, 4], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 5, 6], dtype=torch.int32, device=DEVICE),
    )
    caches = [plain.allocate_kv_caches(4, 4), fused.allocate_kv_caches(4, 4)]
    for cache_pair in zip(*caches, strict=True):
        for plain_cache, fused_cache in zip(*cache_pair, strict=True):
            # the decode token's 3 earlier positions, already cached
            fused_cache.copy_(torch.randn_like(plain_cache))
            plain_cache.copy_(fused_cache)
    with torch.no_grad():
        expected = plain(token_ids, positions, caches[0], metadata)
        out = fused(token_ids, positions, caches[1], metadata)
    assert close(out, expected, 3e-2 if HAS_CUDA else 1e-4)
    assert torch.equal(plain.compute_logits(expected).argmax(-1),
                       fused.compute_logits(out).argmax(-1))


def test_fused_model_handles_llama_without_qk_norm():
    config = parse_model_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 32})
    with torch.no_grad():
        plain = CausalLM(config, dtype=DTYPE, device=DEVICE)
        fill_dummy_weights(plain)
        fused = CausalLM(config, dtype=DTYPE, device=DEVICE)
        fused.load_state_dict(plain.state_dict())
        cuda_fused.fuse_model(fused)
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(3, device=DEVICE),
            block_tables=torch.tensor([[0]], dtype=torch.int32, device=DEVICE),
            context_lens=torch.tensor([3], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 3], dtype=torch.int32, device=DEVICE))
        token_ids = torch.tensor([1, 2, 3], device=DEVICE)
        positions = torch.arange(3, device=DEVICE)
        expected = plain(token_ids, positions, plain.allocate_kv_caches(1, 4), metadata)
        out = fused(token_ids, positions, fused.allocate_kv_caches(1, 4), metadata)
    assert close(out, expected, 3e-2 if HAS_CUDA else 1e-4)
