"""FP8 weights kept in e4m3 for the FP8 GEMMs (gpu/fp8_weights.py, gpu/layers/fp8_linear.py).

On CUDA an FP8 model's projections keep the checkpoint's e4m3 values and scales. The
loading is checked here on the CPU by letting the CPU keep them too
(``FP8_DEVICE_TYPES``): every kept layer holds exactly what the dequantizing load
multiplies out (values times scales = the CPU's float weights, bit for bit), layers the
kernels cannot take stay float, and the model's logits stay within FP8's activation
error of the dequantized model's (Fp8Linear off CUDA computes the kernels' function in
torch). The kernels themselves: tests/test_fp8_gemm.py.
"""

from __future__ import annotations

import pytest
import torch
from test_model_support import (
    dense_config,
    moe_config,
    random_causal_lm,
    random_hybrid_model,
    random_prompts,
    run_executor,
)
from test_quantization import write_fp8_checkpoint

from trio_llm.gpu import quantization
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.layers.fp8_linear import Fp8Linear
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.quantization import E4M3, Fp8Weight
from trio_llm.gpu.tensor_parallel import TensorParallel

CPU = torch.device("cpu")


@pytest.fixture
def cpu_keeps_fp8(monkeypatch):
    monkeypatch.setattr(quantization, "FP8_DEVICE_TYPES", ("cuda", "cpu"))


def _tiny(family: str):
    return random_causal_lm(moe_config(family) if "moe" in family else dense_config(family),
                            seed=3)


def _kept(model) -> dict[str, Fp8Linear]:
    return {name: module for name, module in model.named_modules()
            if isinstance(module, Fp8Linear)}


def _assert_kept_layers_hold_the_dequantized_weights(kept: dict[str, Fp8Linear], plain):
    """Each kept layer's values times its scales = the dequantizing load's weight."""
    parameters = dict(plain.named_parameters())
    for name, module in kept.items():
        assert module.weight.dtype == E4M3 and module.weight_scale.dtype == torch.float32
        dequantized = Fp8Weight(module.weight, module.weight_scale,
                                module.block_size).dequantize()
        # (a hybrid's kept q/k/v/z rows lead its dequantized layer, which fuses b and a)
        assert torch.equal(dequantized, parameters[name + ".weight"][:len(dequantized)]), name


def _assert_kept_experts_hold_the_dequantized_weights(model, plain, block):
    from trio_llm.gpu.layers.moe import SparseMoeBlock

    blocks = [(ours, theirs) for ours, theirs in zip(model.modules(), plain.modules(),
                                                     strict=True)
              if isinstance(ours, SparseMoeBlock)]
    assert blocks
    for ours, theirs in blocks:
        assert ours.experts_gate_up.dtype == ours.experts_down.dtype == E4M3
        assert ours.fp8_block_size == block
        gate_up, down = ours.float_experts(torch.float32)
        assert torch.equal(gate_up, theirs.experts_gate_up)
        assert torch.equal(down, theirs.experts_down)


def _logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits of a prompt's every position (one prefill, the torch attention)."""
    num_tokens = len(token_ids)
    caches = model.allocate_kv_caches(4, 16)
    from trio_llm.gpu.layers.attention import AttentionMetadata

    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens), block_tables=torch.tensor([[0, 1, 2, 3]]),
        context_lens=torch.tensor([num_tokens]), query_start_loc=torch.tensor([0, num_tokens]))
    with torch.no_grad():
        hidden = model(torch.tensor(token_ids), torch.arange(num_tokens), caches, metadata)
        return model.compute_logits(hidden)


@pytest.mark.parametrize(("family", "scheme", "block"), [
    ("qwen3", "block", (32, 32)), ("llama", "channel", None), ("qwen2", "tensor", None),
    ("qwen3_moe", "block", (16, 32)),
    # the shared expert stacked as one more expert (gpu/layers/moe.py): e4m3 with the rest
    ("qwen2_moe_stacked", "block", (16, 32))])
def test_a_kept_fp8_checkpoint_holds_its_e4m3_values_and_scales(
        tmp_path, cpu_keeps_fp8, family, scheme, block):
    keep = ("model.layers.1.self_attn.o_proj.weight",)  # left in float32 by the checkpoint
    write_fp8_checkpoint(_tiny(family), tmp_path / "fp8", tmp_path / "plain", scheme, block,
                         keep)
    model = load_model(tmp_path / "fp8", dtype=torch.float32, device=CPU)
    plain = load_model(tmp_path / "plain", dtype=torch.float32, device=CPU)
    kept = _kept(model)
    assert "layers.0.self_attn.qkv_proj" in kept and "layers.0.self_attn.o_proj" in kept
    assert "layers.1.self_attn.o_proj" not in kept  # the checkpoint's float layer
    assert not any("lm_head" in name for name in kept)
    if "moe" in family:  # the stacked experts in e4m3, each expert's scales
        _assert_kept_experts_hold_the_dequantized_weights(model, plain, block)
        stacked = model.decoder_layers[0].feed_forward.experts_gate_up.shape[0]
        assert stacked == model.config.num_experts + family.endswith("stacked")
    else:
        assert "layers.0.mlp.gate_up_proj" in kept
    assert all(module.block_size == block for module in kept.values())
    _assert_kept_layers_hold_the_dequantized_weights(kept, plain)
    prompt = [5, 17, 300, 2, 9, 44, 101]
    ours, theirs = _logits(model, prompt), _logits(plain, prompt)
    # activations rounded to e4m3 per token (group), through random layers that amplify
    # it: measured at most 0.105 of the logits' norm over these four models
    assert ((ours - theirs).norm() / theirs.norm()).item() < 0.2
    assert not torch.equal(ours, theirs)


def test_online_fp8_keeps_per_row_scales_and_dummy_weights_too(tmp_path, cpu_keeps_fp8):
    _tiny("qwen3").save_pretrained(tmp_path)
    plain = load_model(tmp_path, dtype=torch.float32, device=CPU, quantization="fp8")
    model = load_model(tmp_path, dtype=torch.float32, device=CPU, quantization="fp8")
    kept = _kept(model)
    assert len(kept) == 4 * model.config.num_layers  # qkv, o, gate_up, down in every layer
    assert all(module.weight_scale.shape == (module.weight.shape[0], 1)
               for module in kept.values())
    quantization.FP8_DEVICE_TYPES = ("cuda",)  # (monkeypatch restores it)
    plain = load_model(tmp_path, dtype=torch.float32, device=CPU, quantization="fp8")
    _assert_kept_layers_hold_the_dequantized_weights(kept, plain)

    builtin = resolve_model("tiny")
    plain_dummy = load_model(builtin, dtype=torch.float32, device=CPU, load_format="dummy",
                             quantization="fp8")
    quantization.FP8_DEVICE_TYPES = ("cuda", "cpu")
    dummy = load_model(builtin, dtype=torch.float32, device=CPU, load_format="dummy",
                       quantization="fp8")
    assert _kept(dummy)
    _assert_kept_layers_hold_the_dequantized_weights(_kept(dummy), plain_dummy)


# (architecture, block size): an FP8 checkpoint's linear attention keeps its b and a
# rows apart from q/k/v/z (gpu/layers/linear_attention.py), in the model's dtype, so
# that q/k/v/z stay e4m3 whatever b and a are (here e4m3 in blocks their rows cut);
# Qwen3-Next's checkpoint interleaves q, k, v and z by head group.
HYBRID_CASES = [("Qwen3NextForCausalLM", "block", (16, 16)),
                ("Qwen3NextForCausalLM", "channel", None),
                ("Qwen3_5ForCausalLM", "block", (16, 16)),
                ("Qwen3_5MoeForConditionalGeneration", "block", (16, 32))]


@pytest.mark.parametrize(("architecture", "scheme", "block"), HYBRID_CASES,
                         ids=[f"{name}-{scheme}" for name, scheme, _ in HYBRID_CASES])
def test_a_hybrid_fp8_checkpoint_keeps_its_projections_in_e4m3(
        tmp_path, monkeypatch, cpu_keeps_fp8, architecture, scheme, block):
    """The kept layers hold the dequantizing load's weights, and with the activations
    left unrounded the model's logits are the dequantized model's (within float32
    rounding): every kept row where the model reads it."""
    write_fp8_checkpoint(random_hybrid_model(architecture), tmp_path / "fp8",
                         tmp_path / "plain", scheme, block)
    model = load_model(tmp_path / "fp8", dtype=torch.float32, device=CPU)
    kept = _kept(model)
    assert {"layers.0.linear_attn.in_proj", "layers.0.linear_attn.out_proj",
            "layers.3.self_attn.qkv_proj"} <= kept.keys()
    assert "layers.0.linear_attn.in_proj_ba" not in kept
    # (two ranks dequantize every projection: b and a stay in the fused one)
    rank = load_model(tmp_path / "fp8", dtype=torch.float32, device=CPU,
                      parallel=TensorParallel(rank=0, world_size=2))
    assert rank.decoder_layers[0].linear_attn.in_proj_ba is None and not _kept(rank)
    quantization.FP8_DEVICE_TYPES = ("cuda",)  # (the fixture's monkeypatch restores it)
    _assert_kept_layers_hold_the_dequantized_weights(
        kept, load_model(tmp_path / "fp8", dtype=torch.float32, device=CPU))
    prompts = random_prompts()
    _, plain = run_executor(tmp_path / "plain", prompts, block_size=16)
    quantization.FP8_DEVICE_TYPES = ("cuda", "cpu")
    monkeypatch.setattr(Fp8Linear, "_reference", Fp8Linear._weight_only)
    _, ours = run_executor(tmp_path / "fp8", prompts, block_size=16)
    assert ours.keys() == plain.keys()
    for key, logits in plain.items():  # (F.linear sums in another order than the CPU's)
        torch.testing.assert_close(ours[key], logits, rtol=0, atol=5e-4)


def test_the_cpu_and_tensor_parallel_shards_dequantize(tmp_path):
    """Off the device types that keep FP8 (the CPU engine) nothing is kept."""
    _tiny("qwen3").save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32, device=CPU, quantization="fp8")
    assert not _kept(model)
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())


def test_dummy_fp8_experts_are_the_dequantizing_loads_weights(tmp_path, monkeypatch):
    """``--load-format dummy --quantization fp8`` of an MoE model (the benchmarks'):
    the experts kept in e4m3 with per-row scales hold what the CPU dequantizes."""
    _tiny("qwen3_moe").save_pretrained(tmp_path)
    plain = load_model(tmp_path, dtype=torch.float32, device=CPU, load_format="dummy",
                       quantization="fp8")
    monkeypatch.setattr(quantization, "FP8_DEVICE_TYPES", ("cuda", "cpu"))
    model = load_model(tmp_path, dtype=torch.float32, device=CPU, load_format="dummy",
                       quantization="fp8")
    _assert_kept_experts_hold_the_dequantized_weights(model, plain, None)
    _assert_kept_layers_hold_the_dequantized_weights(_kept(model), plain)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["auto", "fp8"])
def test_a_cuda_fp8_model_gives_the_same_results_at_depth_1_and_2_in_graphs(kv_cache):
    """FP8 GEMMs (and the FP8 KV cache) on CUDA inside captured graphs: depth 2 gives
    depth 1's tokens and logprobs (the same hardware and dtype)."""
    from test_gpu_executor import assert_same_results, scripted_batches

    from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
    from trio_llm.gpu.testing import run_depth_1, run_depth_2

    def build():
        model = load_model(resolve_model("tiny"), dtype=torch.bfloat16,
                           device=torch.device("cuda"), load_format="dummy",
                           quantization="fp8", kv_cache=kv_cache)
        assert len(_kept(model)) == 4 * model.config.num_layers
        executor = CudaModelExecutor(model, model_path=resolve_model("tiny"), num_kv_blocks=64,
                                     block_size=16, max_model_len=256)
        executor.start(CudaExecutorOptions(max_num_seqs=4, use_cuda_graphs=True,
                                           use_fused_kernels=True))
        return executor

    depth_1 = run_depth_1(build(), scripted_batches())
    executor = build()
    assert executor.graphs
    assert_same_results(run_depth_2(executor, scripted_batches()), depth_1)
