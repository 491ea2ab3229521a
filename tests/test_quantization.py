"""FP8 weights (gpu/quantization.py): quantized checkpoints trio-llm does not read are
refused in one line naming their method; FP8 checkpoints (block-wise "fp8",
compressed-tensors per tensor, per channel) load dequantized, giving the tokens and
the logits bit for bit of the same model written with its dequantized weights in
float32; ``--quantization fp8`` rounds linear weights to e4m3 per row and keeps
every row batch-invariant."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_support import (
    NUM_NEW_TOKENS,
    assert_generates_as_transformers,
    assert_same_bits_alone_or_batched,
    dense_config,
    moe_config,
    random_causal_lm,
    random_hybrid_model,
    run_executor,
)

from trio_llm.actors.config import EngineConfig
from trio_llm.api.cli import check_model
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.models import ModelLoadError, parse_model_config
from trio_llm.gpu.quantization import E4M3, E4M3_MAX, is_quantizable
from trio_llm.gpu.tensor_parallel import TensorParallel
from trio_llm.gpu.testing import ExecutorDriver, record_logits

transformers = pytest.importorskip("transformers")

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-6}

# One example of each quantization_config trio-llm does not read, by the name the
# refusal must give.
REFUSED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True,
                     "bnb_4bit_quant_type": "nf4"},
    "bitsandbytes (no quant_method)": {"load_in_8bit": True},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]},
    "gguf": {"quant_method": "gguf"},
    "marlin": {"quant_method": "marlin", "group_size": 128},
    "hqq": {"quant_method": "hqq", "nbits": 4},
    "aqlm": {"quant_method": "aqlm", "nbits_per_codebook": 16},
    "torchao": {"quant_method": "torchao", "quant_type": "int4_weight_only"},
    "fbgemm_fp8": {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
    "modelopt": {"quant_method": "modelopt", "quant_algo": "FP8"},
    "quark": {"quant_method": "quark"},
    "unnamed": {"bits": 4},
    "fp8 static activations": {"quant_method": "fp8", "activation_scheme": "static"},
    "compressed-tensors pack-quantized": {"quant_method": "compressed-tensors",
                                          "format": "pack-quantized"},
    "compressed-tensors int8": {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}}},
    "compressed-tensors 4-bit float weights": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}}},
    "compressed-tensors static input scales": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False}}}},
    "compressed-tensors FP8 KV cache": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}}},
}
REFUSED_WORDS = {
    "bitsandbytes (no quant_method)": "'bitsandbytes'", "unnamed": "unnamed method",
    "fp8 static activations": "activation_scheme 'static'",
    "compressed-tensors pack-quantized": "format 'pack-quantized'",
    "compressed-tensors int8": "format 'int-quantized'",
    "compressed-tensors 4-bit float weights": "4-bit float weights",
    "compressed-tensors static input scales": "static input activation scales",
    "compressed-tensors FP8 KV cache": "kv_cache_scheme",
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_quantization_trio_llm_does_not_read_is_refused_in_one_line(name):
    with pytest.raises(ModelLoadError) as raised:
        parse_model_config(QWEN3 | {"quantization_config": REFUSED[name]})
    message = str(raised.value)
    assert "\n" not in message
    assert REFUSED_WORDS.get(name, repr(name)) in message, message
    assert "not supported" in message


# -- writing FP8 checkpoints ---------------------------------------------------------------


def _is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """A checkpoint tensor an FP8 checkpoint would quantize: projections and experts,
    not the routers, norms, embedding or lm_head."""
    return (tensor.dim() == 2 and "layers." in name and name.endswith(".weight")
            and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight",
                                   "block_sparse_moe.gate.weight")))


def _block_scales(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each block's largest magnitude / 448, the partial blocks at the edges included."""
    rows, columns = block
    num_rows, num_columns = weight.shape
    scale = torch.empty(math.ceil(num_rows / rows), math.ceil(num_columns / columns))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * rows:(i + 1) * rows, j * columns:(j + 1) * columns]
            scale[i, j] = part.abs().max() / E4M3_MAX
    return scale


def _spread(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None
            ) -> torch.Tensor:
    """A scale tensor broadcast to every weight element (by index, not as trio-llm does)."""
    if block is None:
        return scale.reshape(-1, 1).expand(shape) if scale.numel() > 1 else scale.reshape(())
    row_block = torch.arange(shape[0]) // block[0]
    column_block = torch.arange(shape[1]) // block[1]
    return scale[row_block][:, column_block]


def _quantize(weight: torch.Tensor, scheme: str, block: tuple[int, int] | None):
    """(e4m3 values, scale as the checkpoint stores it, the dequantized float32 weight)."""
    weight = weight.to(torch.float32)
    if scheme == "block":
        assert block is not None
        scale = _block_scales(weight, block)
    elif scheme == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    else:
        scale = weight.abs().max().reshape(1) / E4M3_MAX
    spread = _spread(scale, weight.shape, block if scheme == "block" else None)
    values = (weight / spread).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return values, scale, values.to(torch.float32) * spread


def _quantization_config(scheme: str, block: tuple[int, int] | None) -> dict:
    if scheme == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block or ())}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": scheme,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "dynamic": True}}}}


def write_fp8_checkpoint(model, fp8_directory, plain_directory, scheme: str,
                         block: tuple[int, int] | None = None, keep: tuple[str, ...] = ()):
    """``model`` as an FP8 checkpoint in ``fp8_directory`` (``keep``: tensors left in
    float32, as a checkpoint's ignored layers) and, in ``plain_directory``, the same
    model with the dequantized weights in float32."""
    model.save_pretrained(plain_directory)
    tensors = load_file(plain_directory / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_linear_weight(name, tensor) or name in keep:
            quantized[name] = tensor
            continue
        values, scale, dequantized = _quantize(tensor, scheme, block)
        quantized[name] = values
        suffix = "weight_scale_inv" if scheme == "block" else "weight_scale"
        quantized[name.removesuffix("weight") + suffix] = scale
        if scheme != "block":  # FP8_DYNAMIC checkpoints carry none; an unused extra
            quantized[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
        tensors[name] = dequantized
    save_file(tensors, plain_directory / "model.safetensors", metadata={"format": "pt"})
    fp8_directory.mkdir(exist_ok=True)
    save_file(quantized, fp8_directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((plain_directory / "config.json").read_text())
    config["quantization_config"] = _quantization_config(scheme, block)
    (fp8_directory / "config.json").write_text(json.dumps(config))
    return quantized


def _tiny_model(family: str):
    if family in HYBRID_FAMILIES:
        return random_hybrid_model(HYBRID_FAMILIES[family])
    config = moe_config(family) if family in ("qwen3_moe", "mixtral") else dense_config(family)
    return random_causal_lm(config, seed=len(family))


HYBRID_FAMILIES = {"qwen3_5_moe": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}


def _prompts():
    generator = torch.Generator().manual_seed(3)
    # no token 0: transformers' generate masks it as padding (pad_token_id=0)
    return [torch.randint(1, 384, (length,), generator=generator).tolist()
            for length in (5, 23, 1)]


def _assert_same_generation(fp8_directory, plain_directory):
    prompts = _prompts()
    ours, ours_logits = run_executor(fp8_directory, prompts, block_size=16)
    plain, plain_logits = run_executor(plain_directory, prompts, block_size=16)
    assert [r.output_token_ids for r in ours] == [r.output_token_ids for r in plain]
    assert all(len(r.output_token_ids) == NUM_NEW_TOKENS for r in ours)
    assert ours_logits.keys() == plain_logits.keys()
    for key, logits in plain_logits.items():
        assert torch.equal(ours_logits[key], logits), key


# (family, scheme, block size): block-wise with partial edge blocks (40 does not divide
# 64 or 96) and Qwen's 128x128 (one partial block per tiny weight); compressed-tensors
# per tensor and per channel; the MoE families' experts.
CASES = [
    ("qwen3", "block", (40, 40)),
    ("llama", "block", (128, 128)),
    ("qwen2", "tensor", None),
    ("qwen3", "channel", None),
    ("qwen3_moe", "block", (16, 32)),
    ("mixtral", "channel", None),
    # the hybrid family: b and a apart from q/k/v/z (gpu/layers/linear_attention.py)
    ("qwen3_5_moe", "block", (16, 32)),
    ("qwen3_next", "channel", None),
]


@pytest.mark.parametrize(("family", "scheme", "block"), CASES,
                         ids=[f"{f}-{s}" for f, s, _ in CASES])
def test_an_fp8_checkpoint_generates_what_its_dequantized_weights_do(
        tmp_path, family, scheme, block):
    model = _tiny_model(family)
    # one projection left in float32, as a checkpoint's ignored layers are
    keep = ("model.layers.0.self_attn.k_proj.weight",)
    quantized = write_fp8_checkpoint(model, tmp_path / "fp8", tmp_path / "plain", scheme,
                                     block, keep)
    assert sum(tensor.dtype == E4M3 for tensor in quantized.values()) > 8
    _assert_same_generation(tmp_path / "fp8", tmp_path / "plain")


@pytest.mark.parametrize(("family", "block"), [("qwen3", (32, 32)), ("qwen3_moe", (16, 32))])
def test_transformers_loading_the_fp8_checkpoint_generates_what_trio_llm_does(
        tmp_path, family, block):
    """transformers dequantizes a block-wise FP8 checkpoint on the CPU (it needs
    accelerate, not one of trio-llm's dependencies; whole blocks only)."""
    pytest.importorskip("accelerate")
    write_fp8_checkpoint(_tiny_model(family), tmp_path / "fp8", tmp_path / "plain", "block",
                         block)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "fp8", dtype=torch.float32).eval()
    prompts = _prompts()
    requests, recorded = run_executor(tmp_path / "fp8", prompts, block_size=16)
    assert_generates_as_transformers(theirs, prompts, requests, recorded, atol=1e-4)


def test_the_dequantized_weights_are_not_the_float_ones(tmp_path):
    """The test above would pass if the scales were ignored in both directories: the
    dequantized weights differ from the original float ones, and the FP8 model's
    parameters are the dequantized ones."""
    model = _tiny_model("qwen3")
    write_fp8_checkpoint(model, tmp_path / "fp8", tmp_path / "plain", "block", (40, 40))
    loaded = load_model(tmp_path / "fp8", dtype=torch.float32, device=torch.device("cpu"))
    q_proj = model.model.layers[0].self_attn.q_proj.weight.detach()
    ours = loaded.layers[0].self_attn.qkv_proj.weight[:q_proj.shape[0]]
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert torch.equal(ours, plain["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(ours, q_proj)
    torch.testing.assert_close(ours, q_proj, rtol=2**-4, atol=float(q_proj.abs().max()) / 448)


def _rewrite(directory, change):
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_or_misshapen_scale_is_refused(tmp_path):
    model = _tiny_model("qwen3")
    write_fp8_checkpoint(model, tmp_path / "fp8", tmp_path / "plain", "block", (40, 40))
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    _rewrite(tmp_path / "fp8", lambda tensors: tensors.__setitem__(name, torch.ones(3, 3)))
    with pytest.raises(ModelLoadError, match=rf"tensor {name}: shape \[3, 3\] does not fit "
                                             r"block scales of weight \[64, 96\]"):
        load_model(tmp_path / "fp8", dtype=torch.float32, device=torch.device("cpu"))
    _rewrite(tmp_path / "fp8", lambda tensors: tensors.pop(name))
    with pytest.raises(ModelLoadError, match=rf"missing tensor {name} \(the scale of an FP8"):
        load_model(tmp_path / "fp8", dtype=torch.float32, device=torch.device("cpu"))


def test_an_fp8_tensor_without_a_quantization_config_is_refused(tmp_path):
    """Without the config there are no scales: reading e4m3 values as weights serves noise."""
    model = _tiny_model("qwen3")
    write_fp8_checkpoint(model, tmp_path / "fp8", tmp_path / "plain", "block", (40, 40))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"is F8_E4M3, and config.json's "
                                             r"quantization_config does not say how"):
        load_model(tmp_path / "fp8", dtype=torch.float32, device=torch.device("cpu"))


# -- --quantization fp8 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe")
    _tiny_model("qwen3_moe").save_pretrained(directory)
    return directory


def test_online_fp8_rounds_each_linear_weight_to_e4m3_per_row(float_checkpoint):
    cpu = torch.device("cpu")
    plain = dict(load_model(float_checkpoint, dtype=torch.float32, device=cpu)
                 .named_parameters())
    rounded = dict(load_model(float_checkpoint, dtype=torch.float32, device=cpu,
                              quantization="fp8").named_parameters())
    num_quantized = 0
    for name, weight in plain.items():
        if not is_quantizable(name):
            assert torch.equal(rounded[name], weight), name  # norms, routers, embeddings
            continue
        num_quantized += 1
        rows = weight.reshape(-1, weight.shape[-1])
        scale = rows.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        error = (rounded[name].reshape(rows.shape) - rows).abs()
        # half an e4m3 step: 2^-4 of the value for normal numbers, 2^-10 of the scale
        # for subnormal ones (and float32's rounding of the product)
        bound = rows.abs() * 2**-4 + scale * 2**-10 + rows.abs() * 2**-23
        assert (error <= bound).all(), name
        assert not torch.equal(rounded[name], weight), name
        # every value is an e4m3 value times its row's scale (up to float32's rounding)
        values = rounded[name].reshape(rows.shape) / scale
        torch.testing.assert_close(values.to(E4M3).to(torch.float32), values, rtol=2**-20,
                                   atol=0)
    assert num_quantized >= 9  # q/k/v/o, gate_up, down, experts in every layer


def test_online_fp8_keeps_every_row_batch_invariant(float_checkpoint):
    """Each request alone; then together, arriving at different steps, in odd chunks,
    one preempted: every logit the same bits."""
    prompts = _prompts()

    def recorded(requests):
        executor = ModelExecutor.create(EngineConfig(
            model=str(float_checkpoint), block_size=16, num_kv_blocks=256, device="cpu",
            dtype="float32", quantization="fp8"))
        logits = record_logits(executor)
        ExecutorDriver(executor).run(requests)
        return logits

    assert_same_bits_alone_or_batched(recorded, prompts)


def test_online_fp8_is_refused_for_a_quantized_checkpoint(tmp_path):
    model = _tiny_model("qwen3")
    write_fp8_checkpoint(model, tmp_path / "fp8", tmp_path / "plain", "channel")
    with pytest.raises(ModelLoadError, match=r"--quantization fp8 quantizes an unquantized "
                                             r"checkpoint, and this one is quantized already "
                                             r"\(quantization_config 'compressed-tensors'\)"):
        load_model(tmp_path / "fp8", dtype=torch.float32, device=torch.device("cpu"),
                   quantization="fp8")
    with pytest.raises(ModelLoadError, match=r"quantization 'awq' is not supported; "
                                             r"supported: fp8"):
        load_model(tmp_path / "plain", dtype=torch.float32, device=torch.device("cpu"),
                   quantization="awq")


def test_the_cli_refuses_online_fp8_for_a_quantized_checkpoint_in_one_line(tmp_path):
    model = _tiny_model("qwen3")
    write_fp8_checkpoint(model, tmp_path / "fp8", tmp_path / "plain", "block", (128, 128))
    check_model(EngineConfig(model=str(tmp_path / "plain"), quantization="fp8"))
    check_model(EngineConfig(model=str(tmp_path / "fp8")))
    with pytest.raises(SystemExit) as raised:
        check_model(EngineConfig(model=str(tmp_path / "fp8"), quantization="fp8"))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("trio-llm: ") and "leave --quantization out" in message


def _parameters(directory, rank: int, world_size: int, **options) -> dict[str, torch.Tensor]:
    model = load_model(directory, dtype=torch.float32, device=torch.device("cpu"),
                       parallel=TensorParallel(rank=rank, world_size=world_size), **options)
    return dict(model.named_parameters())


def test_each_rank_dequantizes_the_whole_weight_then_takes_its_shard(tmp_path):
    """Under tensor parallelism 2 each rank holds exactly its shard of the dequantized
    weights (a block's scale spans both ranks' columns of down_proj)."""
    write_fp8_checkpoint(_tiny_model("qwen3_moe"), tmp_path / "fp8", tmp_path / "plain",
                         "block", (16, 32))
    for rank in range(2):
        fp8, plain = _parameters(tmp_path / "fp8", rank, 2), _parameters(tmp_path / "plain",
                                                                         rank, 2)
        assert fp8.keys() == plain.keys()
        for name, tensor in plain.items():
            assert torch.equal(fp8[name], tensor), name


def test_online_fp8_scales_a_row_over_its_whole_length_on_every_rank(float_checkpoint):
    """The per-row scale comes from the whole row, not a rank's columns of it: the shards
    of the row-parallel weights put together are the single rank's weights."""
    whole = _parameters(float_checkpoint, 0, 1, quantization="fp8")
    ranks = [_parameters(float_checkpoint, rank, 2, quantization="fp8") for rank in range(2)]
    row_parallel = [name for name in whole if name.endswith(("o_proj.weight", "down_proj.weight",
                                                              "experts_down"))]
    assert len(row_parallel) >= 5
    for name in row_parallel:
        assert torch.equal(torch.cat([rank[name] for rank in ranks], dim=-1), whole[name]), name


def test_online_fp8_dummy_weights_are_e4m3_values_times_row_scales(tmp_path):
    """``--load-format dummy --quantization fp8`` (the benchmarks' FP8 dummy weights): every
    linear weight row is e4m3 values times one scale; the rest as without the flag."""
    write_fp8_checkpoint(_tiny_model("qwen3"), tmp_path / "fp8", tmp_path / "plain", "channel")
    cpu = torch.device("cpu")
    plain = dict(load_model(tmp_path / "plain", dtype=torch.float32, device=cpu,
                            load_format="dummy").named_parameters())
    rounded = dict(load_model(tmp_path / "plain", dtype=torch.float32, device=cpu,
                              load_format="dummy", quantization="fp8").named_parameters())
    for name, weight in rounded.items():
        if not is_quantizable(name):
            assert torch.equal(weight, plain[name]), name
            continue
        scale = plain[name].abs().amax(dim=1, keepdim=True) / E4M3_MAX
        values = weight / scale
        torch.testing.assert_close(values.to(E4M3).to(torch.float32), values, rtol=2**-20,
                                   atol=0)
        assert not torch.equal(weight, plain[name]), name
