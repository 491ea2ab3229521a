"""The weight-only FP8 GEMV (gpu/kernels/triton_gemv.py's ``gemv`` with e4m3 weights and
their scales) and the FP8 layer that takes a decode step's few rows through it.

The GEMV computes ``x W^T + b`` for the dequantized weight W (``Fp8Weight.dequantize``),
the activations unrounded: tested against that product in float64, per output channel
and per block, on shapes that leave every tile and every block partial. Interpreter
mode on the CPU (float32 activations, so the only error is the float32 sums'), compiled
on CUDA (bf16 activations).
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu import quantization  # noqa: E402
from trio_llm.gpu.kernels import triton_gemv  # noqa: E402
from trio_llm.gpu.kernels.triton_gemv import MAX_GEMV_ROWS, GemvConfig, gemv  # noqa: E402
from trio_llm.gpu.layers.fp8_linear import Fp8Layout, Fp8Linear, to_fp8_linear  # noqa: E402
from trio_llm.gpu.layers.linear import Linear  # noqa: E402
from trio_llm.gpu.quantization import Fp8Weight  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
TOLERANCE = 1e-2 if HAS_CUDA else 1e-5  # one bf16 rounding of the output, or float32 sums
# 37 outputs, 300 inputs: no tile and no 128-column block divides them.
NUM_OUTPUTS, NUM_INPUTS = 37, 300
# (block_n, block_k) of the launches: a K tile narrower than a scale block, one wider
# (two blocks a tile, the last partly past K), a program wider than a block's rows
CONFIGS = [GemvConfig(16, 32, 1, 1), GemvConfig(4, 256, 1, 1), GemvConfig(64, 128, 1, 1)]
LAYOUTS = {"channel": None, "blocks-128": (128, 128), "blocks-32x64": (32, 64)}


def random(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def fp8_weight(block_size, num_outputs=NUM_OUTPUTS, num_inputs=NUM_INPUTS, seed=1
               ) -> Fp8Weight:
    weight = random(num_outputs, num_inputs, seed=seed, scale=0.05)
    return (quantization.quantize_rows(weight) if block_size is None
            else quantization.quantize_blocks(weight, block_size))


def on_device(weight: Fp8Weight) -> Fp8Weight:
    return Fp8Weight(weight.values.to(DEVICE), weight.scale.to(DEVICE), weight.block_size)


def fp8_gemv(x, weight: Fp8Weight, bias=None, config=None):
    return gemv(x, weight.values, bias, weight_scale=weight.scale,
                block_size=weight.block_size, config=config)


def relative_error(out, expected):
    return ((out.cpu().double() - expected).norm() / expected.norm()).item()


def dequantized_product(x, weight: Fp8Weight, bias=None):
    """float64 ``x W^T + b`` of the inputs as the kernel reads them."""
    product = x.cpu().double() @ weight.dequantize().cpu().double().T
    return product if bias is None else product + bias.cpu().double()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_weight_the_tiles_cover_exactly_loads_unmasked_to_the_same_product(layout):
    """64 outputs of 256 inputs under 16 x 128 tiles: the launch drops the loads' masks
    (the shape of every decode projection of the built-in models); the product is the
    same as the masked launch's function."""
    weight = on_device(fp8_weight(LAYOUTS[layout], num_outputs=64, num_inputs=256))
    x = random(2, 256, seed=2).to(DTYPE).to(DEVICE)
    bias = random(64, seed=3).to(DTYPE).to(DEVICE)
    out = fp8_gemv(x, weight, bias, GemvConfig(16, 128, 1, 1))
    assert relative_error(out, dequantized_product(x, weight, bias)) < TOLERANCE


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "no-bias"])
def test_fp8_gemv_is_the_product_with_the_dequantized_weight(layout, has_bias):
    weight = on_device(fp8_weight(LAYOUTS[layout]))
    x = random(MAX_GEMV_ROWS, NUM_INPUTS, seed=2).to(DTYPE).to(DEVICE)
    bias = random(NUM_OUTPUTS, seed=3).to(DTYPE).to(DEVICE) if has_bias else None
    for config in CONFIGS:
        # every row count under one launch shape, a decode step's under the others (each
        # (shape, row count) is a compilation on CUDA)
        row_counts = range(1, MAX_GEMV_ROWS + 1) if config is CONFIGS[0] else (1, 2)
        for num_rows in row_counts:
            out = fp8_gemv(x[:num_rows], weight, bias, config)
            assert out.shape == (num_rows, NUM_OUTPUTS) and out.dtype == DTYPE
            expected = dequantized_product(x[:num_rows], weight, bias)
            assert relative_error(out, expected) < TOLERANCE, (config, num_rows)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_fp8_row_is_bitwise_the_same_whatever_rows_share_the_launch(layout):
    weight = on_device(fp8_weight(LAYOUTS[layout], seed=4))
    x = random(MAX_GEMV_ROWS, NUM_INPUTS, seed=5).to(DTYPE).to(DEVICE)
    bias = random(NUM_OUTPUTS, seed=6).to(DTYPE).to(DEVICE)
    config = CONFIGS[0]
    full = fp8_gemv(x, weight, bias, config)
    for num_rows in range(1, MAX_GEMV_ROWS):
        assert torch.equal(fp8_gemv(x[:num_rows], weight, bias, config), full[:num_rows])
    for row in range(MAX_GEMV_ROWS):  # each row alone
        assert torch.equal(fp8_gemv(x[row:row + 1], weight, bias, config), full[row:row + 1])
    assert torch.equal(fp8_gemv(x, weight, bias, config), full)  # run to run


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_fp8_swiglu_launch_is_bitwise_the_projection_then_silu_and_mul(layout):
    """The up rows take their own scales: per channel the second half's rows, per block
    those of rows N + j (at 37 outputs a 32-row block holds gate and up rows both)."""
    from trio_llm.gpu.kernels import triton_layers

    weight = on_device(fp8_weight(LAYOUTS[layout], num_outputs=2 * NUM_OUTPUTS, seed=7))
    x = random(2, NUM_INPUTS, seed=8).to(DTYPE).to(DEVICE)
    bias = random(2 * NUM_OUTPUTS, seed=9).to(DTYPE).to(DEVICE)
    for config in CONFIGS[:2]:
        out = gemv(x, weight.values, bias, weight_scale=weight.scale,
                   block_size=weight.block_size, swiglu=True, config=config)
        product = fp8_gemv(x, weight, bias, config)
        assert torch.equal(out, triton_layers.silu_and_mul(product)), config


def test_the_scales_are_applied_not_just_the_e4m3_values():
    """Scales far from one (and different per block) change the output accordingly; blocks
    of 24 rows (not a power of two: a program's outputs straddle two of them)."""
    weight = fp8_weight((24, 64), seed=7)
    scaled = Fp8Weight(weight.values, weight.scale * random(*weight.scale.shape, seed=8)
                       .abs().add(0.5) * 64, weight.block_size)
    x = random(2, NUM_INPUTS, seed=9).to(DTYPE).to(DEVICE)
    out = fp8_gemv(x, on_device(scaled), config=CONFIGS[0])  # programs of 16 outputs
    assert relative_error(out, dequantized_product(x, scaled)) < TOLERANCE
    assert relative_error(out, dequantized_product(x, weight)) > 0.1


def test_a_bfloat16_input_and_output_on_any_device():
    weight = on_device(fp8_weight((128, 128), seed=10))
    x = random(2, NUM_INPUTS, seed=11).to(torch.bfloat16).to(DEVICE)
    out = fp8_gemv(x, weight, config=CONFIGS[0])
    assert out.dtype == torch.bfloat16
    assert relative_error(out, dequantized_product(x, weight)) < 1e-2


def test_the_default_rule_runs_a_block_layout_in_one_tile_of_many_blocks():
    """A K tile wider than the scale blocks (512 columns over 128-column blocks here)."""
    weight = on_device(fp8_weight((128, 128), num_outputs=5, num_inputs=450, seed=12))
    x = random(2, 450, seed=13).to(DTYPE).to(DEVICE)
    assert triton_gemv.gemv_config(5, 450, triton_gemv.E4M3_CANDIDATE).block_k == 512
    out = fp8_gemv(x, weight)
    assert relative_error(out, dequantized_product(x, weight)) < TOLERANCE
    assert torch.equal(fp8_gemv(x[:1], weight), out[:1])


def test_e4m3_weights_take_their_own_rule_and_bf16_weights_the_default(monkeypatch):
    candidates: list[str] = []
    rule = triton_gemv.gemv_config

    def recording_rule(num_outputs, num_inputs, candidate=triton_gemv.DEFAULT_CANDIDATE):
        candidates.append(candidate)
        return rule(num_outputs, num_inputs, candidate)

    monkeypatch.setattr(triton_gemv, "gemv_config", recording_rule)
    weight = on_device(fp8_weight(None, seed=15))
    x = random(1, NUM_INPUTS, seed=16).to(DTYPE).to(DEVICE)
    fp8_gemv(x, weight)
    gemv(x, weight.dequantize().to(DTYPE).to(DEVICE))
    assert candidates == [triton_gemv.E4M3_CANDIDATE, triton_gemv.DEFAULT_CANDIDATE]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_e4m3_rule_at_many_outputs_matches_the_dequantized_product(layout):
    """E4M3_CANDIDATE's tile where a layer has MIN_PROGRAMS outputs or more (two outputs
    a program, a K tile of 2048 over 128-column blocks), run on 8 outputs."""
    config = triton_gemv.gemv_config(4 * triton_gemv.MIN_PROGRAMS, 2048,
                                     triton_gemv.E4M3_CANDIDATE)
    assert (config.block_n, config.block_k, config.num_warps) == (2, 2048, 2)
    weight = on_device(fp8_weight(LAYOUTS[layout], num_outputs=8, num_inputs=2048, seed=17))
    x = random(2, 2048, seed=18).to(DTYPE).to(DEVICE)
    out = fp8_gemv(x, weight, config=config)
    assert relative_error(out, dequantized_product(x, weight)) < TOLERANCE
    assert torch.equal(fp8_gemv(x[:1], weight, config=config), out[:1])


# -- the layer ---------------------------------------------------------------------------


def fp8_linear(block_size, seed=14, has_bias=True, device=DEVICE, dtype=DTYPE) -> Fp8Linear:
    linear = Linear(NUM_INPUTS, NUM_OUTPUTS, bias=has_bias, dtype=dtype, device=device)
    weight = fp8_weight(block_size, seed=seed)
    layer = to_fp8_linear(linear, Fp8Layout(block_size))
    layer.weight.data.copy_(weight.values)
    layer.weight_scale.data.copy_(weight.scale)
    if has_bias:
        layer.bias.data.copy_(random(NUM_OUTPUTS, seed=seed + 1))
    return layer


def quantized_product(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """float64 ``q(x) W^T + b``: the rows rounded to e4m3 as the GEMMs round them."""
    group = layer.block_size[1] if layer.block_size is not None else x.shape[1]
    values, scales = quantization.quantize_row_groups(x.cpu().to(torch.float32), group)
    rounded = values.double() * scales.double().repeat_interleave(group, 1)[:, :x.shape[1]]
    weight = Fp8Weight(layer.weight.cpu(), layer.weight_scale.cpu(), layer.block_size)
    return rounded @ weight.dequantize().double().T + layer.bias.cpu().double()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_layer_takes_decode_rows_unrounded_and_more_rows_rounded(layout):
    """At most GEMV_ROWS rows: the product of the unrounded rows (the GEMV's function);
    more: the rows rounded to e4m3 first (the GEMMs'). On the CPU the layer computes both
    in torch, and the interpreter's GEMV agrees with its torch function."""
    layer = fp8_linear(LAYOUTS[layout], device=torch.device("cpu"), dtype=torch.float32)
    x = random(triton_gemv.GEMV_ROWS + 1, NUM_INPUTS, seed=16, scale=3)
    weight = Fp8Weight(layer.weight, layer.weight_scale, layer.block_size)
    with torch.no_grad():
        for num_rows in range(1, triton_gemv.GEMV_ROWS + 1):
            out = layer(x[:num_rows])
            expected = dequantized_product(x[:num_rows], weight, layer.bias)
            assert relative_error(out, expected) < 1e-6
            assert relative_error(out, quantized_product(layer, x[:num_rows])) > 1e-3
            kernel = fp8_gemv(x[:num_rows].to(DEVICE), on_device(weight),
                              layer.bias.to(DEVICE), CONFIGS[1])
            assert relative_error(kernel, out.double()) < 1e-5
        out = layer(x)
        assert relative_error(out, quantized_product(layer, x)) < 1e-6
    assert not layer.takes_fp8_rows(16)  # off CUDA no norm quantizes for it


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_per_channel_layer_on_cuda_takes_quantized_rows_only_past_the_gemv_rows(layout):
    layer = fp8_linear(LAYOUTS[layout])
    rows = triton_gemv.GEMV_ROWS
    assert not layer.takes_fp8_rows(rows)
    assert layer.takes_fp8_rows(rows + 1) == (LAYOUTS[layout] is None)
    x = random(rows + 1, NUM_INPUTS, seed=17).to(DTYPE).to(DEVICE)
    with torch.no_grad():
        out = layer(x[:rows])
        weight = Fp8Weight(layer.weight, layer.weight_scale, layer.block_size)
        assert relative_error(out, dequantized_product(x[:rows], weight, layer.bias)) < 1e-2
        assert torch.equal(out, fp8_gemv(x[:rows], weight, layer.bias))


@pytest.mark.gpu
def test_the_fp8_gemv_replays_in_a_cuda_graph():
    """Both layouts at 1 and 2 rows, captured once and replayed on new inputs: the eager
    launches' bits."""
    weights = [on_device(fp8_weight(block, num_outputs=4096, num_inputs=1000, seed=18))
               for block in (None, (128, 128))]
    bias = random(4096, seed=19).to(torch.bfloat16).cuda()
    x = torch.zeros(2, 1000, dtype=torch.bfloat16, device="cuda")

    def step():
        return [fp8_gemv(x[:num_rows], weight, bias) for weight in weights
                for num_rows in (1, 2)]

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (20, 21):
        x.copy_(random(2, 1000, seed=seed).to(torch.bfloat16))
        graph.replay()
        for replayed, eager in zip(captured, step(), strict=True):
            assert torch.equal(replayed, eager)
        assert relative_error(captured[1], dequantized_product(x, weights[0], bias)) < 1e-2


@pytest.mark.gpu
def test_a_fused_fp8_model_skips_the_norms_quantization_for_decode_rows(monkeypatch):
    """The tiny model with FP8 weights per channel, fused on CUDA: a step of one row
    never quantizes a norm's or the SwiGLU's output (every FP8 layer takes it through
    the GEMV), a step of GEMV_ROWS + 1 rows quantizes in the norms for qkv_proj and
    gate_up_proj and in the SwiGLU for down_proj."""
    from trio_llm.gpu.builtin import resolve_model
    from trio_llm.gpu.kernels import triton_layers
    from trio_llm.gpu.layers.attention import AttentionMetadata
    from trio_llm.gpu.loader import load_model
    from trio_llm.gpu.models import cuda_fused

    model = cuda_fused.fuse_model(load_model(
        resolve_model("tiny"), dtype=torch.bfloat16, device=DEVICE, load_format="dummy",
        quantization="fp8"))
    quantizing_norms: list[int] = []
    quantizing_swiglus: list[int] = []

    def counting_norm(x, residual, weight, eps):
        quantizing_norms.append(x.shape[0])
        return triton_layers.rms_norm_fp8(x, residual, weight, eps)

    def counting_swiglu(gate_up):
        quantizing_swiglus.append(gate_up.shape[0])
        return silu_and_mul_fp8(gate_up)

    silu_and_mul_fp8 = triton_layers.silu_and_mul_fp8
    monkeypatch.setattr(cuda_fused.TritonOps, "rms_norm_fp8", staticmethod(counting_norm))
    monkeypatch.setattr(triton_layers, "silu_and_mul_fp8", counting_swiglu)
    caches = model.allocate_kv_caches(8, 16)
    for num_rows in (1, triton_gemv.GEMV_ROWS + 1):
        metadata = AttentionMetadata(
            slot_mapping=torch.arange(num_rows, device=DEVICE),
            block_tables=torch.tensor([[0]], dtype=torch.int32, device=DEVICE),
            context_lens=torch.tensor([num_rows], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, num_rows], dtype=torch.int32, device=DEVICE))
        with torch.no_grad():
            hidden = model(torch.arange(num_rows, device=DEVICE) + 5,
                           torch.arange(num_rows, device=DEVICE), caches, metadata)
        assert torch.isfinite(hidden).all()
    assert quantizing_norms == [triton_gemv.GEMV_ROWS + 1] * (2 * model.config.num_layers)
    assert quantizing_swiglus == [triton_gemv.GEMV_ROWS + 1] * model.config.num_layers
