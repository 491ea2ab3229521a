"""The fused MoE kernel against its per-expert torch reference, and the alignment's invariants.

On CUDA the kernels run compiled, in bf16; elsewhere in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py before triton is imported) on small
float32 shapes, so CI checks the kernels' logic too.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()  # without it, conftest.py runs Triton's interpreter

from trio_llm.gpu.kernels import fused_moe as fused_moe_module  # noqa: E402
from trio_llm.gpu.kernels.fused_moe import (  # noqa: E402
    CONFIGS,
    GemmConfig,
    GroupedConfig,
    RowwiseConfig,
    align_by_expert,
    config_for,
    fused_moe,
    fused_moe_reference,
    input_groups,
    max_sorted_rows,
)

DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
TOLERANCE = 2e-2 if HAS_CUDA else 1e-5
# The smallest tiles tl.dot takes; every block edge here cuts the test shapes unevenly.
SMALL = GroupedConfig(block_m=16, group_m=2, gate_up=GemmConfig(16, 16, 1, 1),
                      down=GemmConfig(32, 16, 1, 1))
# Row blocks long enough for the FP8 tensor cores (fused_moe.FP8_INPUTS_MIN_BLOCK_M), and
# reduction steps an e4m3 dot takes (FP8_DOT_MIN_K; 16-column scale blocks bound them to 16)
LONG_BLOCKS = GroupedConfig(block_m=64, group_m=1, gate_up=GemmConfig(16, 32, 1, 1),
                            down=GemmConfig(32, 32, 1, 1))
# Few programs (the interpreter runs each in Python), several reduction steps each.
ROWWISE = RowwiseConfig(gate_up=GemmConfig(32, 16, 1, 1), down=GemmConfig(32, 16, 1, 1))
# Steps deeper than the FP8 tests' scale blocks: several blocks' spans a step.
ROWWISE_DEEP = RowwiseConfig(gate_up=GemmConfig(16, 64, 1, 1), down=GemmConfig(16, 64, 1, 1))
PATHS = pytest.mark.parametrize("config", [SMALL, ROWWISE], ids=["grouped", "rowwise"])
# Hidden 40 and intermediate 24: neither a multiple of the 16-deep reduction nor of
# the 16/32-wide column blocks.
HIDDEN, INTERMEDIATE = 40, 24


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def random_layer(num_tokens, num_experts, top_k, *, seed=0, hidden=HIDDEN,
                 intermediate=INTERMEDIATE, routing=None):
    """Hidden states, weights and a routing: softmax top-k of random logits unless
    ``routing`` [T, k] names the experts."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=generator)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate**0.5
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    if routing is not None:
        ids = torch.as_tensor(routing, dtype=torch.int64).reshape(num_tokens, top_k)
        weights = torch.rand(num_tokens, top_k, generator=generator)
    as_device = {"device": DEVICE}
    return (x.to(DTYPE).to(**as_device), w13.to(DTYPE).to(**as_device),
            w2.to(DTYPE).to(**as_device), weights.float().to(**as_device),
            ids.to(torch.int32).to(**as_device))


def check_against_reference(layer, config=SMALL):
    out = fused_moe(*layer, config=config)
    expected = fused_moe_reference(*layer)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert relative_error(out, expected) < TOLERANCE


@pytest.mark.parametrize("num_tokens,config", [
    (1, SMALL), (3, SMALL), (17, SMALL), (64, SMALL), (1, ROWWISE), (3, ROWWISE),
], ids=["1-grouped", "3-grouped", "17-grouped", "64-grouped", "1-rowwise", "3-rowwise"])
@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2)])
def test_fused_moe_matches_the_reference(num_tokens, num_experts, top_k, config):
    check_against_reference(random_layer(num_tokens, num_experts, top_k, seed=num_tokens),
                            config)


@PATHS
def test_uneven_loads_and_an_expert_without_tokens(config):
    # Expert 0: 6 rows, expert 2: none, expert 5: one row (the grouped path's blocks
    # hold 16 rows; test_alignment_* covers segments longer than a block).
    routing = [[0, 1]] * 3 + [[0, 3], [0, 4], [5, 6], [7, 3]]
    check_against_reference(random_layer(7, 8, 2, routing=routing, seed=1), config)


def test_all_tokens_to_one_expert():
    # 40 rows of expert 3: three blocks, the last partly padding; the others idle.
    check_against_reference(random_layer(40, 4, 1, routing=[3] * 40, seed=2))


@PATHS
def test_each_token_to_every_expert(config):
    check_against_reference(random_layer(5, 4, 4, routing=[[3, 1, 0, 2]] * 5, seed=3), config)


@PATHS
def test_hidden_states_with_a_row_stride(config):
    # A view of wider rows (a slice of a fused buffer): rows are read by their stride.
    x, w13, w2, weights, ids = random_layer(3, 4, 2, seed=6)
    wide = torch.zeros(3, HIDDEN + 8, dtype=x.dtype, device=x.device)
    wide[:, :HIDDEN] = x
    check_against_reference((wide[:, :HIDDEN], w13, w2, weights, ids), config)


@PATHS
def test_int64_expert_ids_as_torch_topk_gives_them(config):
    x, w13, w2, weights, ids = random_layer(3, 4, 2, seed=7)
    check_against_reference((x, w13, w2, weights, ids.long()), config)


def test_the_table_configurations_match_the_reference():
    # The table's own blocks (BLOCK_M 16 to 64, deep reductions, both paths) on a
    # layer whose dimensions are no multiple of them.
    layer = random_layer(5, 4, 2, seed=4)
    for config in {config for _, config in CONFIGS}:
        check_against_reference(layer, config)


def test_no_tokens_gives_an_empty_output():
    x, w13, w2, weights, ids = random_layer(1, 4, 2)
    out = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, HIDDEN)


def test_mismatched_shapes_are_refused_by_name():
    x, w13, w2, weights, ids = random_layer(3, 4, 2)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, weights, ids[:, :1])
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x[:, :-1], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="one dtype"):
        fused_moe(x.double(), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="int32 or int64"):
        fused_moe(x, w13, w2, weights, ids.float())


def test_the_configuration_table_covers_every_token_count():
    assert config_for(1) == CONFIGS[0][1]
    assert config_for(10**9) == CONFIGS[-1][1]
    assert [bound for bound, _ in CONFIGS] == sorted(bound for bound, _ in CONFIGS)


def write_tuned_table(folder, w13, entries, block=None) -> None:
    num_experts, two_intermediate, hidden = w13.shape
    name = fused_moe_module.tuned_table_name(
        num_experts, hidden, two_intermediate // 2, w13.dtype,
        torch.cuda.get_device_name(w13.device) if HAS_CUDA else "cpu", block)
    (folder / name).write_text(json.dumps({"configs": [
        {"tokens": tokens, "config": fused_moe_module.config_to_json(config)}
        for tokens, config in entries]}))


def test_a_tuned_table_is_read_before_the_default_one(tmp_path, monkeypatch):
    """A table tuned for the layer's shape, dtype and device (benchmarks/moe_kernel_bench.py
    --tune writes one): each tuned count serves the counts above the previous one, and
    counts above the last fall back to the default table."""
    monkeypatch.setenv(fused_moe_module.MOE_CONFIGS_ENV, str(tmp_path))
    layers = {num_tokens: random_layer(num_tokens, 4, 2, seed=num_tokens)
              for num_tokens in (2, 3, 9)}
    write_tuned_table(tmp_path, layers[2][1], [(8, SMALL), (2, ROWWISE)])
    table = fused_moe_module.tuned_table(layers[2][1])
    assert table == ((2, ROWWISE), (8, SMALL))
    assert [config_for(n, table) for n in (1, 2, 3, 8)] == [ROWWISE, ROWWISE, SMALL, SMALL]
    assert config_for(9, table) == config_for(9)
    paths = []
    for kind in ("rowwise", "gate_up"):
        launch = getattr(fused_moe_module, f"launch_{kind}")
        monkeypatch.setattr(fused_moe_module, f"launch_{kind}",
                            lambda *args, kind=kind, launch=launch: (paths.append(kind),
                                                                     launch(*args)))
    for num_tokens, layer in layers.items():
        out = fused_moe(*layer)  # no config given: the tables choose
        assert relative_error(out, fused_moe_reference(*layer)) < TOLERANCE, num_tokens
    # 2 tokens row-wise (tuned), 3 on SMALL's grouped path (tuned), 9 the default's
    assert paths[:2] == ["rowwise", "gate_up"]
    assert paths[2] == ("rowwise" if isinstance(config_for(9), RowwiseConfig) else "gate_up")


def test_a_broken_tuned_table_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv(fused_moe_module.MOE_CONFIGS_ENV, str(tmp_path))
    layer = random_layer(1, 4, 2, seed=8, hidden=24)  # a shape no other test tunes
    write_tuned_table(tmp_path, layer[1], [(4, SMALL)])
    path = next(tmp_path.iterdir())
    path.write_text(path.read_text().replace('"grouped"', '"sideways"'))
    with pytest.raises(ValueError, match=f"{path.name}.*sideways"):
        fused_moe(*layer)


@pytest.mark.parametrize("routing,num_experts,block_m", [
    ([[0, 1]] * 9 + [[0, 3], [0, 4], [5, 6], [7, 3]], 8, 4),
    ([[2]] * 33, 4, 16),
    ([[1, 0], [0, 1], [3, 2]], 64, 16),  # fewer rows than experts: the tighter bound
    ([[e % 5, (e + 2) % 5] for e in range(500)], 5, 8),  # one program places the rows
    ([[e % 7, (e * 3 + 1) % 7] for e in range(600)], 7, 16),  # a second kernel places them
])
def test_alignment_places_every_row_once_and_marks_the_padding(routing, num_experts, block_m):
    topk_ids = torch.tensor(routing, dtype=torch.int32, device=DEVICE)
    num_rows = topk_ids.numel()
    plan = align_by_expert(topk_ids, num_experts, block_m)
    sorted_rows = plan.sorted_rows.cpu()
    block_experts = plan.block_experts.cpu()
    num_padded = int(plan.num_padded_rows.cpu())
    flat_ids = topk_ids.flatten().cpu()
    counts = torch.bincount(flat_ids.long(), minlength=num_experts)
    expected_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert num_padded == expected_padded
    assert sorted_rows.numel() == max_sorted_rows(num_rows, num_experts, block_m)
    assert sorted_rows.numel() >= num_padded
    real = sorted_rows[:num_padded]
    # Every (token, slot) row exactly once; the rest of the padded order is padding.
    assert sorted(real[real < num_rows].tolist()) == list(range(num_rows))
    assert (real[real >= num_rows] == num_rows).all()
    # Each block belongs to one expert, holds only that expert's rows, and the
    # experts come in increasing order; blocks past the total are marked -1.
    num_used = num_padded // block_m
    assert (block_experts[num_used:] == -1).all()
    used = block_experts[:num_used]
    assert (used[1:] >= used[:-1]).all()
    for block, expert in enumerate(used.tolist()):
        rows = real[block * block_m:(block + 1) * block_m]
        rows = rows[rows < num_rows]
        assert rows.numel() > 0  # padding never fills a whole block
        assert (flat_ids[rows.long()] == expert).all()
    # Each expert pads to a multiple of the block, so at most block_m - 1 padding rows each.
    padding_per_expert = torch.bincount(used.long(), minlength=num_experts) * block_m - counts
    assert ((padding_per_expert >= 0) & (padding_per_expert < block_m)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300, 2000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen3_moe_shapes_with_the_table_configurations(num_tokens, dtype):
    # qwen3-30b-a3b's layer: 128 experts, top-8, hidden 2048, intermediate 768.
    x, w13, w2, weights, ids = random_layer(num_tokens, 128, 8, hidden=2048, intermediate=768,
                                            seed=num_tokens)
    layer = (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)
    check_against_reference(layer, config_for(num_tokens))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 2000],
                         ids=["rowwise", "grouped-one-launch-alignment", "grouped-two-launch"])
def test_fused_moe_is_captured_in_a_cuda_graph(num_tokens):
    layer = random_layer(num_tokens, 8, 2, seed=5)
    expected = fused_moe(*layer)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(*layer)
    # Same inputs, new routing written in place: the replay must follow it.
    graph.replay()
    assert torch.equal(captured, expected)
    x, w13, w2, weights, ids = layer
    ids.copy_((ids + 1) % 8)
    graph.replay()
    assert relative_error(captured, fused_moe_reference(x, w13, w2, weights, ids)) < TOLERANCE


@pytest.mark.gpu
def test_a_pdl_decode_chain_gives_the_same_bits_inside_a_graph(enable_pdl):
    """TRIO_LLM_PDL=1 (gpu/kernels/pdl.py): a norm, the router's GEMV, the routing, the
    row-wise MoE kernels and the next norm, each launched while the one before runs,
    captured in a CUDA graph and replayed on new inputs: the bits of plain launches."""
    from trio_llm.gpu.kernels import triton_layers
    from trio_llm.gpu.kernels.moe_routing import route_topk
    from trio_llm.gpu.kernels.triton_gemv import gemv
    from trio_llm.gpu.testing import assert_graph_replays_plain_results

    x, w13, w2, _, _ = random_layer(1, 8, 2, seed=21)
    residual, norm_weight = torch.randn_like(x), torch.ones(x.shape[1], device=DEVICE,
                                                            dtype=DTYPE)
    router = torch.randn(8, x.shape[1], device=DEVICE, dtype=DTYPE)
    inputs = [torch.randn_like(x) for _ in range(2)]

    def step() -> torch.Tensor:
        normed, summed = triton_layers.add_rms_norm(x, residual, norm_weight, 1e-6)
        weights, ids = route_topk(gemv(normed, router), 2, normalize=True,
                                  round_to_input=False)
        out = fused_moe(normed, w13, w2, weights, ids, config=config_for(1))
        return triton_layers.add_rms_norm(out, summed, norm_weight, 1e-6)[0]

    assert_graph_replays_plain_results(step, x, inputs, enable_pdl)


# -- FP8 experts ----------------------------------------------------------------------------


def fp8_layer(layer, block):
    """``layer`` with its experts in e4m3, block scales (or per-row scales: ``block``
    None), and the same layer with the dequantized weights (the reference's)."""
    from trio_llm.gpu.kernels.fused_moe import ExpertScales
    from trio_llm.gpu.quantization import quantize_blocks, quantize_rows

    x, w13, w2, weights, ids = layer

    def quantize(stacked):
        parts = [quantize_rows(w.float().cpu()) if block is None
                 else quantize_blocks(w.float().cpu(), block) for w in stacked]
        return (torch.stack([p.values for p in parts]).to(DEVICE),
                torch.stack([p.scale for p in parts]).to(DEVICE),
                torch.stack([p.dequantize() for p in parts]).to(DTYPE).to(DEVICE))

    w13_values, w13_scale, w13_plain = quantize(w13)
    w2_values, w2_scale, w2_plain = quantize(w2)
    scales = ExpertScales(w13_scale, w2_scale, block)
    return ((x, w13_values, w2_values, weights, ids), scales,
            (x, w13_plain, w2_plain, weights, ids))


@pytest.mark.parametrize("block", [(16, 16), (8, 32), None], ids=["16x16", "8x32", "per-row"])
@pytest.mark.parametrize("num_tokens,config", [
    (3, SMALL), (17, SMALL), (17, LONG_BLOCKS), (2, ROWWISE), (2, ROWWISE_DEEP)],
    ids=["3-grouped", "17-grouped", "17-grouped-fp8-inputs", "2-rowwise",
         "2-rowwise-deep-steps"])
def test_fp8_experts_compute_their_dequantized_weights_product(block, num_tokens, config):
    """e4m3 experts with block (partial at the edges: 40 and 24 are no multiples of 16
    or 32) or per-row scales = the reference over the dequantized weights: with the
    activations as they are on the row-wise path and in short row blocks (weight-only),
    through e4m3 per row and scale group in long row blocks (the FP8 tensor cores)."""
    layer, scales, plain = fp8_layer(random_layer(num_tokens, 4, 2, seed=num_tokens), block)
    out = fused_moe(*layer, config=config, scales=scales)
    groups = input_groups(config, scales, HIDDEN, INTERMEDIATE)
    # long row blocks quantize, unless 16-column blocks cut their steps under FP8_DOT_MIN_K
    assert (groups is not None) == (config is LONG_BLOCKS and block != (16, 16))
    expected = fused_moe_reference(*plain, fp8_groups=groups)
    if groups is not None:
        # the activations' rounding is no rounding error of the kernel's: it is the
        # reference's to the last bits in float32 on the CPU. In bf16 on the GPU the
        # intermediate's own rounding flips a few of its e4m3 roundings (the H100 gave
        # 4x, not 10x, closer to this reference than to the weight-only one)
        closer = 10 if DTYPE == torch.float32 else 3
        assert relative_error(out, fused_moe_reference(*plain)) > closer * relative_error(
            out, expected)
    assert relative_error(out, expected) < TOLERANCE
    # the scales matter: the e4m3 values alone give another output
    unscaled = fused_moe(*layer, config=config, scales=dataclasses.replace(
        scales, w13=torch.ones_like(scales.w13), w2=torch.ones_like(scales.w2)))
    assert relative_error(unscaled, expected) > 0.5


def test_block_scaled_experts_take_tiles_whose_scaled_products_fit_the_registers():
    """Block scales scale each step's product before adding it, so the grouped path's
    columns are halved until twice the accumulators fit (a spilling tile ran 3.9x slower
    on the H100); per-row scales chain their MMAs and keep the tile, as does the row-wise
    path (one row a program)."""
    from trio_llm.gpu.kernels.fused_moe import ExpertScales

    prefill = CONFIGS[-1][1]  # 128-row blocks, 8 warps: 128 x 128 gate/up, 256-wide down
    assert isinstance(prefill, GroupedConfig)
    none = torch.empty(0)
    blocks = ExpertScales(none, none, (128, 128)).fit(prefill, 2048, 768)
    assert (blocks.gate_up.block_n, blocks.down.block_n) == (prefill.gate_up.block_n // 2,
                                                             prefill.down.block_n // 2)
    assert blocks.gate_up.block_k == prefill.gate_up.block_k  # 64 divides the 128 columns
    assert ExpertScales(none, none).fit(prefill, 2048, 768) == prefill
    # the row-wise path scales each block's span of a step: deep steps stay where the
    # blocks' columns are a power of two, and shrink to divide them where they are not
    deep = RowwiseConfig(GemmConfig(2, 1024, 1, 1), GemmConfig(2, 1024, 1, 3))
    assert ExpertScales(none, none, (128, 128)).fit(deep, 2048, 768) == deep
    odd = ExpertScales(none, none, (128, 96)).fit(deep, 2048, 768)
    assert (odd.gate_up.block_k, odd.down.block_k) == (32, 32)
    # a tile that fits already is kept: 16 rows of 128 columns over 4 warps
    decode = CONFIGS[1][1]
    assert ExpertScales(none, none, (128, 128)).fit(decode, 2048, 768) == decode


def test_block_scaled_experts_read_a_tuned_table_of_their_own(tmp_path, monkeypatch):
    """FP8 experts with block scales want other tiles than per-row ones (each step's
    product is scaled): each kind reads the table tuned for it (moe_kernel_bench.py
    --tune --fp8 [--fp8-block R C]), and the kernel runs the configuration read."""
    monkeypatch.setenv(fused_moe_module.MOE_CONFIGS_ENV, str(tmp_path))
    layer, blocks, plain = fp8_layer(random_layer(3, 4, 2, seed=11, hidden=56), (16, 16))
    _, rows, _ = fp8_layer(random_layer(3, 4, 2, seed=11, hidden=56), None)
    w13 = layer[1]
    write_tuned_table(tmp_path, w13, [(4, ROWWISE)], block=(16, 16))
    write_tuned_table(tmp_path, w13, [(4, SMALL)])
    assert "block=16x16" in fused_moe_module.tuned_table_name(4, 56, 24, w13.dtype, "x",
                                                              (16, 16))
    assert fused_moe_module.tuned_table(w13, blocks) == ((4, ROWWISE),)
    assert fused_moe_module.tuned_table(w13, rows) == ((4, SMALL),)
    paths = []
    launch = fused_moe_module.launch_rowwise
    monkeypatch.setattr(fused_moe_module, "launch_rowwise",
                        lambda *args: (paths.append("rowwise"), launch(*args)))
    out = fused_moe(*layer, scales=blocks)  # 3 tokens: the block table's row-wise entry
    assert paths == ["rowwise"]
    assert relative_error(out, fused_moe_reference(*plain)) < TOLERANCE


def test_fp8_experts_with_scales_of_the_wrong_shape_are_refused():
    layer, scales, _ = fp8_layer(random_layer(2, 4, 2), (16, 16))
    with pytest.raises(ValueError, match=r"FP8 w2 must be e4m3 with scales \[4, 3, 2\]"):
        fused_moe(*layer, scales=dataclasses.replace(scales, w2=scales.w2[:, :2]))
