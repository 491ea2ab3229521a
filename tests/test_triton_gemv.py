"""The Triton GEMV against float32 ``F.linear``, its batch invariance, and the fused
model that uses it for small decode batches.

Interpreter mode on the CPU, compiled on CUDA. The interpreter runs every program
in Python, so the CPU tests use small shapes and blocks that give a launch a few
programs of a few K steps (the last program and the last step partly masked).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu.builtin import resolve_model  # noqa: E402
from trio_llm.gpu.kernels import triton_gemv, triton_layers  # noqa: E402
from trio_llm.gpu.kernels.triton_gemv import MAX_GEMV_ROWS, GemvConfig, gemv  # noqa: E402
from trio_llm.gpu.layers.linear import Linear, chunked_linear  # noqa: E402
from trio_llm.gpu.loader import load_model  # noqa: E402
from trio_llm.gpu.models import cuda_fused  # noqa: E402
from trio_llm.gpu.models.base import AttentionMetadata, CausalLM  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# 37 outputs in blocks of 16, 100 inputs in steps of 32: three programs of four steps.
NUM_OUTPUTS, NUM_INPUTS = 37, 100
SMALL_BLOCKS = GemvConfig(block_n=16, block_k=32, num_warps=1, num_stages=1)
QWEN3_SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096),
                (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]


def random(*shape, seed=0, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)


def relative_error(out, expected):
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def float32_linear(x, weight, bias=None):
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


@pytest.mark.parametrize("has_bias", [True, False])
def test_gemv_matches_float32_linear_for_every_row_count(has_bias):
    x = random(MAX_GEMV_ROWS, NUM_INPUTS, seed=1)
    weight = random(NUM_OUTPUTS, NUM_INPUTS, seed=2)
    bias = random(NUM_OUTPUTS, seed=3) if has_bias else None
    for num_rows in range(1, MAX_GEMV_ROWS + 1):
        out = gemv(x[:num_rows], weight, bias, config=SMALL_BLOCKS)
        assert out.shape == (num_rows, NUM_OUTPUTS) and out.dtype == torch.bfloat16
        # one bf16 rounding of the float32 sum
        assert relative_error(out, float32_linear(x[:num_rows], weight, bias)) < 1e-2


def test_a_weight_the_tiles_cover_exactly_gives_the_masked_launchs_bits():
    """64 x 256 under 16 x 32 tiles loads without masks; padded to 65 x 257 (masked
    loads, the padding's products are zeros) the first 64 outputs are the same bits."""
    x = random(2, 256, seed=7)
    weight, bias = random(64, 256, seed=8), random(64, seed=9)
    even = gemv(x, weight, bias, config=SMALL_BLOCKS)
    padded = gemv(torch.nn.functional.pad(x, (0, 1)), torch.nn.functional.pad(weight, (0, 1, 0, 1)),
                  torch.nn.functional.pad(bias, (0, 1)), config=SMALL_BLOCKS)
    assert torch.equal(even, padded[:, :64])
    assert relative_error(even, float32_linear(x, weight, bias)) < 1e-2


def test_a_row_is_bitwise_the_same_whatever_rows_share_the_launch():
    x = random(MAX_GEMV_ROWS, NUM_INPUTS, seed=4)
    weight, bias = random(NUM_OUTPUTS, NUM_INPUTS, seed=5), random(NUM_OUTPUTS, seed=6)
    full = gemv(x, weight, bias, config=SMALL_BLOCKS)
    for num_rows in range(1, MAX_GEMV_ROWS):
        assert torch.equal(gemv(x[:num_rows], weight, bias, config=SMALL_BLOCKS),
                           full[:num_rows])
    assert torch.equal(gemv(x, weight, bias, config=SMALL_BLOCKS), full)  # run to run


@pytest.mark.parametrize("has_bias", [True, False])
def test_a_swiglu_launch_is_bitwise_the_projection_then_silu_and_mul(has_bias):
    """The gate/up projection's SwiGLU in the GEMV's epilogue (a program owns gate row j
    and up row j, each rounded as a plain launch stores it): the bits of the plain
    launch then ``silu_and_mul``, under small tiles (the last partly masked) and the
    default rule, which the launch takes from the whole weight's shape."""
    x = random(3, NUM_INPUTS, seed=21)
    weight = random(2 * NUM_OUTPUTS, NUM_INPUTS, seed=22)
    bias = random(2 * NUM_OUTPUTS, seed=23) if has_bias else None
    for config in (SMALL_BLOCKS, None):
        for num_rows in (1, 2, 3):
            out = gemv(x[:num_rows], weight, bias, swiglu=True, config=config)
            assert out.shape == (num_rows, NUM_OUTPUTS) and out.dtype == torch.bfloat16
            product = gemv(x[:num_rows], weight, bias, config=config)
            assert torch.equal(out, triton_layers.silu_and_mul(product)), (config, num_rows)
            gate, up = float32_linear(x[:num_rows], weight, bias).chunk(2, dim=-1)
            assert relative_error(out, F.silu(gate) * up) < 2e-2  # three bf16 roundings


@pytest.mark.parametrize("candidate", sorted(triton_gemv.CANDIDATES))
def test_every_candidate_rule_matches_float32_linear(candidate):
    x, weight = random(3, 300, seed=7), random(5, 300, seed=8)  # one partly masked K step
    config = triton_gemv.gemv_config(5, 300, candidate)
    out = gemv(x, weight, config=config)
    assert relative_error(out, float32_linear(x, weight)) < 1e-2
    assert torch.equal(gemv(x[:1], weight, config=config), out[:1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    x, weight = random(2, NUM_INPUTS, seed=9, dtype=dtype), random(NUM_OUTPUTS, NUM_INPUTS,
                                                                   seed=10, dtype=dtype)
    out = gemv(x, weight, config=SMALL_BLOCKS)
    assert out.dtype == dtype
    tolerance = 1e-2 if dtype == torch.float16 else 1e-5
    assert relative_error(out, float32_linear(x, weight)) < tolerance


def test_rows_of_a_wider_tensor_and_no_rows():
    wide = random(2, NUM_INPUTS + 12, seed=11)
    x = wide[:, 5:5 + NUM_INPUTS]  # rows NUM_INPUTS + 12 apart
    weight = random(NUM_OUTPUTS, NUM_INPUTS, seed=12)
    out = gemv(x, weight, config=SMALL_BLOCKS)
    assert torch.equal(out, gemv(x.contiguous(), weight, config=SMALL_BLOCKS))
    assert gemv(x[:0], weight).shape == (0, NUM_OUTPUTS)


@pytest.mark.parametrize("candidate", sorted(triton_gemv.CANDIDATES))
def test_rules_give_power_of_two_blocks_and_enough_programs(candidate):
    for num_outputs, num_inputs in QWEN3_SHAPES:
        config = triton_gemv.gemv_config(num_outputs, num_inputs, candidate)
        assert config.block_n & (config.block_n - 1) == 0
        assert config.block_k & (config.block_k - 1) == 0 and config.block_k <= num_inputs
        num_programs = -(-num_outputs // config.block_n)
        assert num_programs >= triton_gemv.MIN_PROGRAMS or config.block_n == 1


def test_few_outputs_take_all_of_k_in_one_step():
    """An MoE router (128 or 256 experts) under the default rule: one K step a program,
    a warp per 1024 inputs; it still matches float32 and stays batch invariant."""
    for num_outputs, num_inputs in [(128, 2048), (256, 2048), (128, 4096), (60, 2048)]:
        config = triton_gemv.gemv_config(num_outputs, num_inputs)
        assert config.block_k == num_inputs and config.num_warps == num_inputs // 1024
    config = triton_gemv.gemv_config(8, 1000)
    assert (config.block_k, config.num_warps) == (1024, 1)
    x, weight = random(2, 1000, seed=13), random(8, 1000, seed=14)
    out = gemv(x, weight, config=config)
    assert relative_error(out, float32_linear(x, weight)) < 1e-2
    assert torch.equal(gemv(x[:1], weight, config=config), out[:1])


@pytest.fixture
def large_blocks_on_cpu(monkeypatch):
    """A few large programs per launch: the interpreter runs each one in Python."""
    if not HAS_CUDA:
        monkeypatch.setattr(triton_gemv, "gemv_config",
                            lambda num_outputs, num_inputs, **_: GemvConfig(256, 128, 1, 1))


def count_gemv_calls(monkeypatch) -> list[tuple[int, bool]]:
    """Record (the row count, whether a SwiGLU launch) of every gemv the fused layers
    launch."""
    calls: list[tuple[int, bool]] = []

    def counting_gemv(x, weight, bias=None, **options):
        calls.append((x.shape[0], options.get("swiglu", False)))
        return gemv(x, weight, bias, **options)

    monkeypatch.setattr(cuda_fused, "gemv", counting_gemv)
    return calls


def test_gemv_linear_takes_only_small_unchunked_batches(monkeypatch, large_blocks_on_cpu):
    linear = Linear(NUM_INPUTS, NUM_OUTPUTS, bias=True, dtype=torch.float32, device=DEVICE)
    linear.weight.data = random(NUM_OUTPUTS, NUM_INPUTS, seed=13, dtype=torch.float32)
    linear.bias.data = random(NUM_OUTPUTS, seed=14, dtype=torch.float32)
    cuda_fused.use_gemv(linear)
    assert isinstance(linear, cuda_fused.GemvLinear)
    calls = count_gemv_calls(monkeypatch)
    rows = triton_gemv.GEMV_ROWS
    x = random(rows + 1, NUM_INPUTS, seed=15, dtype=torch.float32)
    with torch.no_grad():
        out = linear(x[:rows])
        assert calls == [(rows, False)]
        assert relative_error(out, F.linear(x[:rows], linear.weight, linear.bias)) < 1e-5
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias))
        linear.num_rows_per_chunk = 4  # batch-invariant mode keeps its row chunks
        assert torch.equal(linear(x[:1]), chunked_linear(x[:1], linear.weight, linear.bias, 4))
    assert calls == [(rows, False)]


def tiny_model() -> CausalLM:
    return load_model(resolve_model("tiny"), dtype=torch.float32, device=DEVICE)


def test_fused_model_with_gemv_matches_the_plain_model_on_a_decode_batch(
        monkeypatch, large_blocks_on_cpu):
    plain = tiny_model()
    fused = cuda_fused.fuse_model(tiny_model())
    cuda_fused.use_gemv(fused)  # fuse_model does it on CUDA only
    for model in (plain, fused):
        model.set_batch_invariant(False)  # the CPU default chunks rows and skips gemv
    calls = count_gemv_calls(monkeypatch)
    monkeypatch.setattr(triton_gemv, "GEMV_ROWS", MAX_GEMV_ROWS)  # the kernel at 3 rows
    # three decode tokens at positions 3, 6 and 2, their earlier positions cached
    token_ids = torch.tensor([5, 17, 300], device=DEVICE)
    positions = torch.tensor([3, 6, 2], device=DEVICE)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([3, 10, 18], device=DEVICE),
        block_tables=torch.tensor([[0, 3], [1, 2], [4, 5]], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([4, 7, 3], dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=DEVICE),
    )
    caches = [plain.allocate_kv_caches(6, 4), fused.allocate_kv_caches(6, 4)]
    for cache_pair in zip(*caches, strict=True):
        for plain_cache, fused_cache in zip(*cache_pair, strict=True):
            fused_cache.copy_(torch.randn_like(plain_cache))
            plain_cache.copy_(fused_cache)
    with torch.no_grad():
        expected = plain(token_ids, positions, caches[0], metadata)
        out = fused(token_ids, positions, caches[1], metadata)
        expected_logits, logits = plain.compute_logits(expected), fused.compute_logits(out)
    num_layers = plain.config.num_layers
    # qkv, o, down per layer and the lm_head; gate_up with its SwiGLU in one launch
    assert sorted(calls) == [(3, False)] * (3 * num_layers + 1) + [(3, True)] * num_layers
    tolerance = 1e-3 if HAS_CUDA else 1e-4  # float32 throughout
    assert relative_error(out, expected) < tolerance
    assert relative_error(logits, expected_logits) < tolerance
    assert torch.equal(logits.argmax(-1), expected_logits.argmax(-1))


@pytest.mark.gpu
def test_a_pdl_launch_gives_the_same_bits_inside_a_graph(enable_pdl):
    """TRIO_LLM_PDL=1 (gpu/kernels/pdl.py): a norm that lets the next kernel launch early,
    then gemv launched with PDL (plain and SwiGLU), captured in a CUDA graph and replayed
    on new inputs: the same bits as the plain launches."""
    from trio_llm.gpu.testing import assert_graph_replays_plain_results

    x, residual = random(1, 2048, seed=15), random(1, 2048, seed=16)
    norm_weight, weight = random(2048, seed=17), random(5120, 2048, seed=18)
    inputs = [random(1, 2048, seed=seed) for seed in (19, 20)]

    def step() -> torch.Tensor:
        normed, _ = triton_layers.add_rms_norm(x, residual, norm_weight, 1e-6)
        return torch.cat([gemv(normed, weight), gemv(normed, weight, swiglu=True)], dim=1)

    assert_graph_replays_plain_results(step, x, inputs, enable_pdl)
