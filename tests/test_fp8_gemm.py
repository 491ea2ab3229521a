"""The FP8 GEMM kernels (gpu/kernels/fp8_gemm.py) against float references.

In Triton's interpreter on the CPU (fp8 casts and fp8 dots work there), compiled on
CUDA; ``torch._scaled_mm`` needs a GPU with FP8 (Hopper): its tests are GPU-marked.
"""

from __future__ import annotations

import json

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu.kernels import fp8_gemm  # noqa: E402
from trio_llm.gpu.quantization import (  # noqa: E402
    E4M3,
    E4M3_MAX,
    Fp8Activation,
    Fp8Weight,
    quantize_row_groups,
    quantize_rows,
)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


def exactly_quantizable(num_rows: int, num_columns: int, group: int, seed: int) -> torch.Tensor:
    """Rows whose every group holds e4m3 values times a power of two, one of them +-448:
    each group's scale is that power of two and each value/scale an e4m3 value, so no
    rounding happens (Triton 3.7's interpreter rounds to e4m3 without the carry: see
    tests/test_triton_kv_fp8.py)."""
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(num_rows, num_columns, generator=generator) * 60).to(E4M3)
    values = values.to(torch.float32)
    values[:, ::group] = E4M3_MAX * torch.sign(torch.randn(num_rows, 1, generator=generator))
    powers = 2.0 ** torch.randint(-12, 2, (num_rows, -(-num_columns // group)),
                                  generator=generator)
    return values * powers.repeat_interleave(group, 1)[:, :num_columns]


@pytest.mark.parametrize(("num_columns", "group"), [(96, None), (200, 64), (2500, 1024)],
                         ids=["per-token", "groups-partial-last", "groups-over-blocks"])
def test_activation_quantization_stores_the_references_bits(num_columns, group):
    x = exactly_quantizable(5, num_columns, group or num_columns, seed=num_columns)
    if HAS_CUDA:  # any input: the GPU rounds as torch does
        x = torch.randn(5, num_columns) * 3
    x[3] = 0.0  # a row of zeros keeps a scale of 1
    x = x.to(DTYPE)
    values, scales = fp8_gemm.quantize_groups(x.to(DEVICE), group)
    expected_values, expected_scales = quantize_row_groups(x.to(torch.float32),
                                                           group or num_columns)
    assert torch.equal(scales.cpu(), expected_scales)
    assert torch.equal(bits(values.cpu()), bits(expected_values))
    assert scales[3].eq(1.0).all()


def test_activation_scales_match_on_any_input():
    """Scales are float arithmetic the interpreter does exactly, whatever the values."""
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(2)) * 5).to(DTYPE)
    _, scales = fp8_gemm.quantize_groups(x.to(DEVICE), 128)
    assert torch.equal(scales.cpu(), quantize_row_groups(x.to(torch.float32), 128)[1])


def test_scales_stored_group_by_group_are_the_same_scales():
    """The layout cuBLASLt's block-scaled GEMM reads (strides (1, rows)) holds the same
    scales and values as the row-major one."""
    x = (torch.randn(7, 300, generator=torch.Generator().manual_seed(3)) * 5).to(DTYPE)
    values, scales = fp8_gemm.quantize_groups(x.to(DEVICE), 128)
    by_group_values, by_group = fp8_gemm.quantize_groups(x.to(DEVICE), 128,
                                                         scales_by_group=True)
    assert by_group.shape == (7, 3) and by_group.stride() == (1, 7)
    assert torch.equal(by_group.cpu(), scales.cpu())
    assert torch.equal(bits(by_group_values.cpu()), bits(values.cpu()))
    padded_values, padded = fp8_gemm.quantize_groups(x.to(DEVICE), 128, scales_by_group=True,
                                                     row_multiple=16)
    assert padded.shape == (16, 3) and padded.stride() == (1, 16)
    assert padded_values.shape == (16, 300)
    assert torch.equal(padded[:7].cpu(), scales.cpu())
    assert torch.equal(bits(padded_values[:7].cpu()), bits(values.cpu()))


def test_cublas_blocks_only_for_whole_128_blocks_on_hopper():
    weight = torch.empty(256, 512, dtype=E4M3, device=DEVICE)
    hopper = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
    assert fp8_gemm.takes_cublas_blocks(weight, (128, 128)) == hopper
    assert not fp8_gemm.takes_cublas_blocks(weight, (64, 128))
    assert not fp8_gemm.takes_cublas_blocks(weight[:200], (128, 128))
    assert not fp8_gemm.takes_cublas_blocks(weight[:, :384], (128, 128))  # 3 a row


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 8, 13, 200, 1000])
@pytest.mark.parametrize("has_bias", [False, True])
def test_cublas_blocks_agree_with_the_triton_block_gemm(num_rows, has_bias):
    """``cublas_block_linear`` = the Triton block GEMM of the same quantized input, at one
    row, a multiple of 8 and row counts that are no multiple of anything (the padding),
    with and without a bias."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("cuBLASLt's 128 x 128 block scales: Hopper only")
    weight = block_quantized_weight(384, 512, (128, 128), seed=num_rows)
    w, w_scale = weight.values.cuda(), weight.scale.cuda()
    generator = torch.Generator().manual_seed(num_rows)
    x = (torch.randn(num_rows, 512, generator=generator) * 2).to(torch.bfloat16).cuda()
    bias = (torch.randn(384, generator=generator).to(torch.bfloat16).cuda()
            if has_bias else None)
    values, scales = fp8_gemm.quantize_groups(x, 128)
    expected = fp8_gemm.block_fp8_matmul(values, scales, w, w_scale, (128, 128), bias,
                                         torch.float32)
    out = fp8_gemm.cublas_block_linear(x, w, w_scale, bias)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
    assert torch.equal(fp8_gemm.block_scaled_linear(x, w, w_scale, (128, 128), bias), out)


def block_quantized_weight(num_out: int, num_in: int, block: tuple[int, int], seed: int
                           ) -> Fp8Weight:
    """A random weight in e4m3 with one scale per block (partial edge blocks)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_out, num_in, generator=generator) * 0.05
    rows, columns = block
    num_block_rows, num_block_columns = -(-num_out // rows), -(-num_in // columns)
    padded = torch.zeros(num_block_rows * rows, num_block_columns * columns)
    padded[:num_out, :num_in] = weight
    blocks = padded.view(num_block_rows, rows, num_block_columns, columns)
    scale = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
    expanded = scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)
    values = (padded / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)[:num_out, :num_in]
    return Fp8Weight(values.contiguous(), scale, block)


SHAPES = [
    # rows, out, in, block: partial edge blocks in every dimension; decode-like rows
    (3, 200, 300, (128, 128)),
    (37, 96, 256, (32, 64)),
    (1, 64, 128, (64, 128)),
    # groups narrower than an e4m3 dot's 32 columns (multiplied widened to float32)
    (20, 48, 80, (16, 16)),
]


@pytest.mark.parametrize(("num_rows", "num_out", "num_in", "block"), SHAPES)
@pytest.mark.parametrize("has_bias", [False, True])
def test_the_block_gemm_is_the_float_product_of_its_dequantized_operands(
        num_rows, num_out, num_in, block, has_bias):
    weight = block_quantized_weight(num_out, num_in, block, seed=num_out)
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, num_in, generator=generator) * 2
    values, scales = quantize_row_groups(x, block[1])
    bias = torch.randn(num_out, generator=generator) if has_bias else None
    out = fp8_gemm.block_fp8_matmul(
        values.to(DEVICE), scales.to(DEVICE), weight.values.to(DEVICE),
        weight.scale.to(DEVICE), block, bias.to(DTYPE).to(DEVICE) if has_bias else None,
        DTYPE, config=fp8_gemm.BlockGemmConfig(block_m=16, block_n=32))
    dequantized_x = values.to(torch.float32) * scales.repeat_interleave(block[1], 1)[:, :num_in]
    expected = dequantized_x.double() @ weight.dequantize().double().T
    if has_bias:
        expected += bias.to(DTYPE).double()
    tolerance = 1e-2 if HAS_CUDA else 1e-5  # bf16 output on CUDA, float32 sums here
    error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
    assert error < tolerance


def test_the_block_linear_quantizes_its_input_per_token_group():
    """``block_scaled_linear`` on float input = the GEMM of its quantized input, and
    within FP8's error of the float product."""
    weight = block_quantized_weight(64, 256, (64, 128), seed=4)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(9))
    if not HAS_CUDA:
        x = exactly_quantizable(4, 256, 128, seed=9) / 64
    x = x.to(DTYPE)
    out = fp8_gemm.block_scaled_linear(x.to(DEVICE), weight.values.to(DEVICE),
                                       weight.scale.to(DEVICE), (64, 128), None).cpu()
    values, scales = quantize_row_groups(x.to(torch.float32), 128)
    expected = fp8_gemm.block_fp8_matmul(values.to(DEVICE), scales.to(DEVICE),
                                         weight.values.to(DEVICE), weight.scale.to(DEVICE),
                                         (64, 128), None, torch.float32).cpu()
    if HAS_CUDA:
        torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    plain = x.double() @ weight.dequantize().double().T
    assert ((out.double() - plain).norm() / plain.norm()).item() < 0.1


@pytest.mark.parametrize(("num_rows", "num_out", "num_in"), [(3, 200, 300), (37, 96, 256)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_the_rowwise_triton_gemm_is_the_float_product_of_its_dequantized_operands(
        num_rows, num_out, num_in, has_bias):
    """Per-token activation scales, per-channel weight scales; partial tiles in every
    dimension."""
    generator = torch.Generator().manual_seed(num_rows)
    weight = quantize_rows(torch.randn(num_out, num_in, generator=generator) * 0.05)
    values, scales = quantize_row_groups(torch.randn(num_rows, num_in, generator=generator),
                                         num_in)
    bias = torch.randn(num_out, generator=generator).to(DTYPE) if has_bias else None
    out = fp8_gemm.rowwise_fp8_matmul(
        values.to(DEVICE), scales.to(DEVICE), weight.values.to(DEVICE),
        weight.scale.to(DEVICE), bias.to(DEVICE) if has_bias else None, DTYPE,
        fp8_gemm.RowwiseGemmConfig(block_m=16, block_n=32, block_k=64))
    expected = (values.double() * scales.double()) @ weight.dequantize().double().T
    if has_bias:
        expected += bias.double()
    tolerance = 1e-2 if HAS_CUDA else 1e-5  # bf16 output on CUDA, float32 sums here
    error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
    assert error < tolerance


def test_the_rowwise_gemm_is_triton_s_up_to_its_row_count_and_cublas_s_elsewhere():
    most, narrowest = fp8_gemm.ROWWISE_MAX_ROWS, fp8_gemm.ROWWISE_MIN_OUTPUTS
    assert fp8_gemm.rowwise_gemm_config(3, narrowest) == fp8_gemm.ROWWISE_CONFIG
    assert fp8_gemm.rowwise_gemm_config(most, 6 * narrowest) == fp8_gemm.ROWWISE_CONFIG
    assert fp8_gemm.rowwise_gemm_config(most + 1, narrowest) is None
    assert fp8_gemm.rowwise_gemm_config(3, narrowest // 2) is None


SMALL_TILE = fp8_gemm.RowwiseGemmConfig(16, 32, 64, 4, 2)


def test_a_tuned_table_s_entry_serves_the_row_counts_above_the_one_before():
    tuned = ((8, SMALL_TILE), (64, None))  # cuBLAS's from 9 to 64 rows
    narrow = fp8_gemm.ROWWISE_MIN_OUTPUTS // 2  # the default rule gives it cuBLAS's
    assert fp8_gemm.rowwise_gemm_config(3, narrow, tuned) == SMALL_TILE
    assert fp8_gemm.rowwise_gemm_config(8, narrow, tuned) == SMALL_TILE
    assert fp8_gemm.rowwise_gemm_config(9, narrow, tuned) is None
    assert fp8_gemm.rowwise_gemm_config(9, fp8_gemm.ROWWISE_MIN_OUTPUTS, tuned) is None
    # past the table: the default rule
    assert (fp8_gemm.rowwise_gemm_config(65, fp8_gemm.ROWWISE_MIN_OUTPUTS, tuned)
            == fp8_gemm.ROWWISE_CONFIG)
    assert fp8_gemm.rowwise_gemm_config(65, narrow, tuned) is None


def device_name(weight: torch.Tensor) -> str:
    return torch.cuda.get_device_name(weight.device) if weight.is_cuda else "cpu"


def write_table(folder, weight: torch.Tensor, entries: list[dict]) -> None:
    name = fp8_gemm.tuned_table_name(*weight.shape, device_name(weight))
    (folder / name).write_text(json.dumps({"configs": entries}))


def test_a_weight_finds_its_shape_s_table_in_the_folder_the_variable_names(
        tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(fp8_gemm.FP8_GEMM_CONFIGS_ENV, str(tmp_path))
    weight = torch.zeros(96, 160, dtype=E4M3, device="cuda" if HAS_CUDA else "cpu")
    write_table(tmp_path, weight, [{"rows": 64, "tile": None},
                                   {"rows": 8, "tile": [16, 32, 64, 4, 2], "us": 1.0}])
    with caplog.at_level("INFO", logger="trio_llm.gpu.kernels.tuned_tables"):
        assert fp8_gemm.tuned_table(weight) == ((8, SMALL_TILE), (64, None))
        assert not caplog.records
        assert fp8_gemm.tuned_table(weight[:, :128]) == ()  # another shape: none, said once
        assert fp8_gemm.tuned_table(weight[:, :128]) == ()
    assert [record.getMessage() for record in caplog.records] == [
        f"no tuned table {fp8_gemm.tuned_table_name(96, 128, device_name(weight))} in "
        f"{fp8_gemm.BUILTIN_CONFIGS}: the kernel's default tiles serve this shape"]


def test_a_malformed_table_is_refused_naming_its_file(tmp_path, monkeypatch):
    monkeypatch.setenv(fp8_gemm.FP8_GEMM_CONFIGS_ENV, str(tmp_path))
    weight = torch.zeros(32, 48, dtype=E4M3)
    write_table(tmp_path, weight, [{"rows": 8, "tile": [16, 32]}])
    with pytest.raises(ValueError, match="tuned FP8 GEMM table .*out=32,in=48"):
        fp8_gemm.tuned_table(weight)


def test_a_step_takes_the_tile_its_table_gives(tmp_path, monkeypatch):
    """scaled_mm_rowwise looks its weight's table up: a table that sends 37 rows to a
    tile the default rule never takes (a narrow layer) gives the tile's product."""
    monkeypatch.setenv(fp8_gemm.FP8_GEMM_CONFIGS_ENV, str(tmp_path))
    weight = quantize_rows(torch.randn(96, 128, generator=torch.Generator().manual_seed(3))
                           * 0.05)
    values = weight.values.to(DEVICE)
    write_table(tmp_path, values, [{"rows": 64, "tile": [16, 32, 64, 4, 2]}])
    chosen = []
    real = fp8_gemm.rowwise_fp8_matmul
    monkeypatch.setattr(fp8_gemm, "rowwise_fp8_matmul",
                        lambda *args: chosen.append(args[-1]) or real(*args))
    # rows a norm's kernel quantized (Triton's interpreter rounds to e4m3 otherwise)
    rows, scales = quantize_row_groups(torch.randn(
        37, 128, generator=torch.Generator().manual_seed(4)), 128)
    out = fp8_gemm.scaled_mm_rowwise(
        Fp8Activation(rows.to(DEVICE), scales.to(DEVICE), DTYPE), values,
        weight.scale.to(DEVICE), None)
    assert chosen == [SMALL_TILE]
    expected = (rows.double() * scales.double()) @ weight.dequantize().double().T
    error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
    assert error < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(HAS_CUDA and torch.cuda.get_device_capability() < (9, 0),
                    reason="row-wise torch._scaled_mm needs an FP8 GPU (Hopper)")
@pytest.mark.parametrize("num_rows", [1, 2, 37, 300])
def test_the_rowwise_scaled_mm_is_the_float_product_of_its_dequantized_operands(num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    weight = quantize_rows(torch.randn(384, 512, generator=generator) * 0.05)
    x = (torch.randn(num_rows, 512, generator=generator) * 2).to(torch.bfloat16)
    bias = torch.randn(384, generator=generator).to(torch.bfloat16)
    out = fp8_gemm.scaled_mm_rowwise(x.cuda(), weight.values.cuda(), weight.scale.cuda(),
                                     bias.cuda()).cpu()
    values, scales = quantize_row_groups(x.float(), 512)
    expected = (values.double() * scales.double()) @ weight.dequantize().double().T
    expected += bias.double()
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.gpu
def test_the_fp8_gemms_replay_in_a_cuda_graph():
    """No host synchronisation: captured once, replayed on new input, the same output."""
    weight = block_quantized_weight(256, 512, (128, 128), seed=1)
    w, w_scale = weight.values.cuda(), weight.scale.cuda()
    rows = quantize_rows(torch.randn(256, 512) * 0.05)
    row_values, row_scale = rows.values.cuda(), rows.scale.cuda()
    x = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        values, scales = fp8_gemm.quantize_groups(x)
        return (fp8_gemm.block_scaled_linear(x, w, w_scale, (128, 128), None),
                fp8_gemm.scaled_mm_rowwise(x, row_values, row_scale, None),
                fp8_gemm.rowwise_fp8_matmul(values, scales, row_values, row_scale, None,
                                            x.dtype, fp8_gemm.ROWWISE_CONFIG))

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn(8, 512, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    for replayed, eager in zip(captured, step(), strict=True):
        assert torch.equal(replayed, eager)


@pytest.mark.parametrize("with_residual", [False, True], ids=["norm", "add-norm"])
def test_the_norm_quantized_in_its_kernel_is_the_norm_then_the_quantization(with_residual):
    """``rms_norm_fp8`` = ``add_rms_norm`` (or ``rms_norm``) then ``quantize_groups`` per
    row, bit for bit (each kernel rounds alike, in the interpreter as on the GPU)."""
    from trio_llm.gpu.kernels import triton_layers

    generator = torch.Generator().manual_seed(8)
    x = (torch.randn(5, 96, generator=generator) * 3).to(DTYPE).to(DEVICE)
    residual = torch.randn(5, 96, generator=generator).to(DTYPE).to(DEVICE)
    weight = (torch.rand(96, generator=generator) + 0.5).to(DTYPE).to(DEVICE)
    x[2] = 0.0
    if with_residual:
        residual[2] = 0.0  # a row of zeros: scale 1
        normed, expected_residual = triton_layers.add_rms_norm(x, residual, weight, 1e-6)
    else:
        normed, expected_residual = triton_layers.rms_norm(x, weight, 1e-6), x
    activation, new_residual = triton_layers.rms_norm_fp8(
        x, residual if with_residual else None, weight, 1e-6)
    values, scales = fp8_gemm.quantize_groups(normed)
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(activation.scales, scales) and activation.dtype == DTYPE
    assert torch.equal(bits(activation.values), bits(values))
    assert activation.scales[2].item() == 1.0


@pytest.mark.parametrize("chunk", [None, 64], ids=["one-pass", "two-passes"])
def test_the_swiglu_quantized_in_its_kernel_is_the_swiglu_then_the_quantization(
        chunk, monkeypatch):
    """``silu_and_mul_fp8`` = ``silu_and_mul`` then ``quantize_groups`` per row, bit for
    bit, at a width below its chunk and one that fills it (or in chunks of 64: two
    passes, the last chunk partly past the row)."""
    from trio_llm.gpu.kernels import triton_layers

    if chunk is not None:
        monkeypatch.setattr(triton_layers, "SILU_FP8_BLOCK", chunk)
    generator = torch.Generator().manual_seed(9)
    for intermediate in (96, 1024):
        gate_up = (torch.randn(5, 2 * intermediate, generator=generator) * 3).to(DTYPE)
        gate_up = gate_up.to(DEVICE)
        gate_up[3] = 0.0  # a row of zeros: scale 1
        activation = triton_layers.silu_and_mul_fp8(gate_up)
        values, scales = fp8_gemm.quantize_groups(triton_layers.silu_and_mul(gate_up))
        assert torch.equal(activation.scales, scales) and activation.dtype == DTYPE
        assert torch.equal(bits(activation.values), bits(values))
        assert activation.scales[3].item() == 1.0
