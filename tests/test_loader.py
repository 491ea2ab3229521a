"""Loading: config.json and safetensors (single or sharded), dtypes, dummy weights,
and one clear ModelLoadError, naming the file and the problem, for each failure."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_support import moe_config, random_causal_lm, random_hybrid_model

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.builtin import TINY_CONFIG, tiny_weights
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import ModelLoadError, load_model
from trio_llm.gpu.models import read_model_config
from trio_llm.gpu.tensor_parallel import TensorParallel

CPU = torch.device("cpu")
SMALL_CONFIG = TINY_CONFIG | {"vocab_size": 96, "num_hidden_layers": 2}


@pytest.fixture
def model_dir(tmp_path):
    """A small Qwen3 checkpoint in Hugging Face layout (single safetensors file)."""
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(SMALL_CONFIG))
    save_file(tiny_weights(SMALL_CONFIG), str(directory / "model.safetensors"))
    return directory


def _load(directory, **options):
    options = {"dtype": torch.float32, "device": CPU} | options
    return load_model(directory, **options)


def _edit_config(directory, **changes):
    path = directory / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _shard(directory, num_shards=3):
    """Split model.safetensors into shards listed by an index file."""
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::num_shards]}
        save_file(part, str(directory / file_name))
        weight_map |= dict.fromkeys(part, file_name)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def test_weights_are_loaded_and_fused(model_dir):
    tensors = tiny_weights(SMALL_CONFIG)
    model = _load(model_dir)
    layer = model.layers[1]
    expected_qkv = torch.cat([tensors[f"model.layers.1.self_attn.{name}_proj.weight"]
                              for name in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, expected_qkv)
    expected_gate_up = torch.cat([tensors[f"model.layers.1.mlp.{name}_proj.weight"]
                                  for name in ("gate", "up")])
    assert torch.equal(layer.mlp.gate_up_proj.weight, expected_gate_up)
    assert model.lm_head.weight is model.embed_tokens  # tied


def test_sharded_checkpoint_loads_the_same(model_dir):
    single = _load(model_dir).state_dict()
    _shard(model_dir)
    sharded = _load(model_dir).state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes(model_dir, dtype):
    model = _load(model_dir, dtype=dtype)
    assert {parameter.dtype for parameter in model.parameters()} == {dtype}


def test_untied_embeddings_need_lm_head(model_dir):
    _edit_config(model_dir, tie_word_embeddings=False)
    with pytest.raises(ModelLoadError, match="missing tensor.*lm_head.weight"):
        _load(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn(96, 64)
    save_file(tensors, str(model_dir / "model.safetensors"))
    model = _load(model_dir)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_dummy_weights_need_no_safetensors(model_dir):
    (model_dir / "model.safetensors").unlink()
    first = _load(model_dir, load_format="dummy").state_dict()
    second = _load(model_dir, load_format="dummy").state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert all(torch.isfinite(tensor).all() for tensor in first.values())


def test_dummy_only_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_LLM_CACHE", str(tmp_path))
    description = ModelExecutor.describe(EngineConfig(model="qwen3-0.6b", max_model_len=4096))
    assert description.vocab_size == 151936
    assert description.max_model_len == 4096
    assert description.model_config.num_layers == 28
    with pytest.raises(ModelLoadError, match="load_format='dummy'"):
        ModelExecutor.create(EngineConfig(model="qwen3-0.6b", load_format="safetensors"))


# -- errors --------------------------------------------------------------------------


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: missing file"):
        _load(model_dir)


def test_invalid_config_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: not valid JSON"):
        _load(model_dir)


def test_config_missing_a_field(model_dir):
    config = dict(SMALL_CONFIG)
    del config["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError,
                       match=r"config\.json: missing or malformed field.*hidden_size"):
        _load(model_dir)


def test_config_field_of_the_wrong_kind(model_dir):
    (model_dir / "config.json").write_text(json.dumps(dict(SMALL_CONFIG, hidden_size="abc")))
    with pytest.raises(ModelLoadError, match=r"config\.json: missing or malformed field.*abc"):
        _load(model_dir)


def test_missing_weights_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"missing file.*safetensors.*dummy"):
        _load(model_dir)


def test_missing_shard(model_dir):
    _shard(model_dir)
    (model_dir / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError,
                       match=r"model-00002-of-00003\.safetensors: missing file \(listed in"):
        _load(model_dir)


def test_unsupported_architecture(model_dir):
    _edit_config(model_dir, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported architecture "
                       r"GPTNeoXForCausalLM; supported: LlamaForCausalLM, Qwen2ForCausalLM, "
                       r"Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, "
                       r"Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, "
                       r"Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, "
                       r"Qwen3MoeForCausalLM, Qwen3NextForCausalLM"):
        _load(model_dir)


@pytest.mark.parametrize(("changes", "problem"), [
    ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "unsupported rope type"),
])
def test_unsupported_features(model_dir, changes, problem):
    _edit_config(model_dir, **changes)
    with pytest.raises(ModelLoadError, match=problem):
        _load(model_dir)


def test_shape_mismatch(model_dir):
    _edit_config(model_dir, intermediate_size=96)
    with pytest.raises(ModelLoadError) as caught:
        _load(model_dir)
    message = str(caught.value)
    assert message.endswith("model.safetensors: shape mismatch for tensor "
                            "model.layers.0.mlp.down_proj.weight: expected [64, 96], "
                            "found [64, 128]")


def test_missing_tensor(model_dir):
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError,
                       match=r"missing tensor\(s\).*model\.layers\.1\.self_attn\.k_norm\.weight"):
        _load(model_dir)


def test_tensor_missing_from_its_indexed_shard(model_dir):
    tensors = _shard(model_dir)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    moved = "model.norm.weight"
    index["weight_map"][moved] = next(name for name in index["weight_map"].values()
                                      if name != index["weight_map"][moved])
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert moved in tensors
    with pytest.raises(ModelLoadError, match=rf"missing tensor {moved} \(the index says"):
        _load(model_dir)


def test_corrupt_safetensors(model_dir):
    (model_dir / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: cannot read"):
        _load(model_dir)


def test_model_type_alone_names_the_family(model_dir):
    config = dict(SMALL_CONFIG)
    del config["architectures"]
    (model_dir / "config.json").write_text(json.dumps(config))
    assert read_model_config(model_dir).architecture == "Qwen3ForCausalLM"


def test_llama_directory_from_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=1, mlp_bias=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model_config = read_model_config(tmp_path)
    assert (model_config.family, model_config.mlp_bias, model_config.qk_norm) == (
        "llama", True, False)
    model = _load(tmp_path)
    assert model.layers[0].mlp.gate_up_proj.bias is not None


def test_cpu_kv_cache_is_sized_from_its_memory_budget(model_dir):
    config = EngineConfig(model=str(model_dir), block_size=16, cpu_kv_cache_gib=0.001,
                          device="cpu", dtype="float32")
    executor = ModelExecutor.create(config)
    # keys and values, 2 layers, 16 tokens a block, 2 KV heads of 16 float32s
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4
    assert executor.num_kv_blocks == int(0.001 * 2**30 // bytes_per_block)
    assert executor.kv_caches[0][0].shape == (executor.num_kv_blocks, 16, 2, 16)


# -- experts in two 3-D tensors a layer ---------------------------------------------------


def _fuse_experts(directory, fused_directory) -> None:
    """``directory``'s checkpoint with each layer's experts as two 3-D tensors, as
    Qwen3.5-MoE's releases store them: experts.gate_up_proj [experts, 2 x intermediate,
    hidden] (an expert's gate rows, then its up rows) and experts.down_proj."""
    tensors = load_file(directory / "model.safetensors")
    prefixes = sorted({name.split("experts.")[0] for name in tensors if ".experts." in name})
    for prefix in prefixes:
        count = 1 + max(int(name[len(prefix):].split(".")[1]) for name in tensors
                        if name.startswith(prefix + "experts."))
        parts = {kind: [tensors.pop(f"{prefix}experts.{expert}.{kind}.weight")
                        for expert in range(count)]
                 for kind in ("gate_proj", "up_proj", "down_proj")}
        tensors[prefix + "experts.gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(parts["gate_proj"], parts["up_proj"],
                                              strict=True)])
        tensors[prefix + "experts.down_proj"] = torch.stack(parts["down_proj"])
    shutil.copytree(directory, fused_directory)
    save_file(tensors, fused_directory / "model.safetensors", metadata={"format": "pt"})


def _moe_checkpoint(architecture: str, directory):
    if architecture == "Qwen3MoeForCausalLM":
        model = random_causal_lm(moe_config("qwen3_moe"), seed=5)
    else:
        model = random_hybrid_model(architecture)
    model.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("architecture", ["Qwen3_5MoeForCausalLM",
                                          "Qwen3_5MoeForConditionalGeneration",
                                          "Qwen3MoeForCausalLM"])
def test_experts_stored_as_3d_tensors_load_as_one_tensor_an_expert_does(tmp_path,
                                                                        architecture):
    """Qwen3.5-MoE's releases store each layer's experts in two 3-D tensors, where
    transformers writes one tensor an expert: both load the same parameters, on one
    rank and on each of two, from one file or from shards."""
    directory = _moe_checkpoint(architecture, tmp_path / "experts")
    _fuse_experts(directory, tmp_path / "fused")
    shutil.copytree(tmp_path / "fused", tmp_path / "sharded")
    _shard(tmp_path / "sharded")
    for rank, world_size in ((0, 1), (0, 2), (1, 2)):
        models = [_load(path, parallel=TensorParallel(rank=rank, world_size=world_size))
                  for path in (directory, tmp_path / "fused", tmp_path / "sharded")]
        ours, *others = (dict(model.named_parameters()) for model in models)
        assert any("experts_gate_up" in name for name in ours)
        for theirs in others:
            assert ours.keys() == theirs.keys()
            for name, parameter in ours.items():
                assert torch.equal(parameter, theirs[name]), name


def _shorter(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[:, :-1].contiguous()


def _in_e4m3(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float8_e4m3fn)


@pytest.mark.parametrize(("name", "change", "message"), [
    ("model.layers.0.mlp.experts.gate_up_proj", _shorter,
     r"shape mismatch for tensor model\.layers\.0\.mlp\.experts\.gate_up_proj"),
    ("model.layers.0.mlp.experts.down_proj", _in_e4m3,
     r"experts\.down_proj holds FP8 experts in one 3-D tensor"),
], ids=["shape", "fp8"])
def test_a_3d_experts_tensor_it_cannot_read_is_refused_by_name(tmp_path, name, change, message):
    directory = _moe_checkpoint("Qwen3_5MoeForCausalLM", tmp_path / "experts")
    _fuse_experts(directory, tmp_path / "fused")
    path = tmp_path / "fused" / "model.safetensors"
    tensors = load_file(path)
    tensors[name] = change(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    _edit_config(tmp_path / "fused", quantization_config={"quant_method": "fp8",
                                                          "weight_block_size": [16, 16]})
    with pytest.raises(ModelLoadError, match=message):
        _load(tmp_path / "fused")
