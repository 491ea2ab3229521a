"""Built-in models: deterministic, cached, atomic, offline."""

import json
import shutil
import threading
from pathlib import Path

import pytest

from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.gpu import builtin
from trio_llm.gpu.builtin import MARKER_FILE, resolve_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_LLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _file_bytes(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_tiny_is_built_into_the_cache(cache):
    path = resolve_model("tiny")
    assert path == cache / "tiny"
    names = {file.name for file in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"} <= names
    assert not [name for name in cache.iterdir() if name.name.startswith(".")]


def test_tiny_tokenizer_matches_the_model(cache):
    path = resolve_model("tiny")
    config = json.loads((path / "config.json").read_text())
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == config["vocab_size"] == 2048
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    text = "The old bridge stood over the river for three hundred years."
    token_ids = tokenizer.encode(text)
    assert len(token_ids) < len(text) / 2  # real merges, not bytes
    assert tokenizer.decode(token_ids) == text


def test_tiny_chat_template_and_eos(cache):
    tokenizer = Tokenizer.from_dir(resolve_model("tiny"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    im_end, endoftext = tokenizer.encode("<|im_end|><|endoftext|>")
    assert tokenizer.eos_token_ids == [im_end, endoftext]
    assert {im_end, endoftext} <= tokenizer.all_special_ids


def test_build_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIO_LLM_CACHE", str(tmp_path / "first"))
    first = _file_bytes(resolve_model("tiny"))
    monkeypatch.setenv("TRIO_LLM_CACHE", str(tmp_path / "second"))
    second = _file_bytes(resolve_model("tiny"))
    assert first == second


def test_cached_copy_is_reused(cache):
    path = resolve_model("tiny")
    (path / "config.json").write_text("{}")  # would be rewritten by a rebuild
    assert resolve_model("tiny") == path
    assert (path / "config.json").read_text() == "{}"


def test_outdated_copy_is_rebuilt(cache):
    path = resolve_model("tiny")
    expected = _file_bytes(path)
    (path / MARKER_FILE).write_text(json.dumps({"name": "tiny", "version": -1}))
    (path / "model.safetensors").write_bytes(b"broken")
    assert _file_bytes(resolve_model("tiny")) == expected


def test_concurrent_first_uses_agree(cache):
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(resolve_model("tiny")))
               for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert paths == [cache / "tiny"] * 3
    assert (cache / "tiny" / MARKER_FILE).is_file()
    assert [entry.name for entry in cache.iterdir()] == ["tiny"]


def test_directory_is_used_as_is(tmp_path, cache):
    assert resolve_model(str(tmp_path)) == tmp_path
    assert not cache.exists()


def test_unknown_name_lists_builtin_names(cache):
    with pytest.raises(ValueError, match="tiny, tiny-moe, qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, "
                                         "qwen3-moe-small"):
        resolve_model("no-such-model")


def test_qwen3_dummy_configs(cache):
    path = resolve_model("qwen3-0.6b")
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        1024, 28, 151936)
    assert config["tie_word_embeddings"] is True
    assert not (path / "model.safetensors").exists()
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == 151936
    assert tokenizer.decode([151935]) == "<|filler_151935|>"
    assert builtin.QWEN3_8B_CONFIG["num_hidden_layers"] == 36
    assert builtin.QWEN3_8B_CONFIG["tie_word_embeddings"] is False


def test_qwen3_30b_a3b_has_the_published_dimensions():
    """Qwen3-30B-A3B's shape (issue 23): read through the Qwen3-MoE family's parser."""
    from trio_llm.gpu.models import parse_model_config

    config = parse_model_config(builtin.QWEN3_30B_A3B_CONFIG)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size) == (48, 2048, 32, 4, 128, 151936)
    assert (config.num_experts, config.num_experts_per_tok,
            config.moe_intermediate_size) == (128, 8, 768)
    assert builtin.is_dummy_only("qwen3-30b-a3b") and builtin.is_dummy_only("qwen3-moe-small")


def test_the_fp8_builtins_are_block_scaled_like_qwens_fp8_releases():
    from trio_llm.gpu.models import parse_model_config

    for name, plain in (("qwen3-8b-fp8", "qwen3-8b"), ("qwen3-30b-a3b-fp8", "qwen3-30b-a3b"),
                        ("qwen3.5-27b-fp8", "qwen3.5-27b"),
                        ("qwen3.5-35b-a3b-fp8", "qwen3.5-35b-a3b")):
        config = parse_model_config(builtin.DUMMY_ONLY_CONFIGS[name])
        assert config.quantization is not None
        assert config.quantization.block_size == (128, 128)
        assert config.num_layers == parse_model_config(
            builtin.DUMMY_ONLY_CONFIGS[plain]).num_layers
        assert builtin.is_dummy_only(name)


def _fake_hub_cache(root: Path, repo_id: str, commit: str, source: Path) -> Path:
    """The layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/COMMIT}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_hugging_face_id_resolves_from_the_local_cache(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = _fake_hub_cache(tmp_path, "acme/tiny-chat", "a" * 40, resolve_model("tiny"))
    assert resolve_model("acme/tiny-chat") == snapshot
    assert resolve_model("acme/tiny-chat", revision="a" * 40) == snapshot


def test_hugging_face_id_not_cached_says_where_it_looked(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=f"not in the local Hugging Face cache \\({tmp_path}"):
        resolve_model("Qwen/Qwen3-0.6B")


def test_builtin_random_weights_are_announced(caplog: pytest.LogCaptureFixture) -> None:
    from trio_llm.actors.config import EngineConfig
    from trio_llm.gpu.executor import _load_format

    with caplog.at_level("WARNING"):
        assert _load_format(EngineConfig(model="qwen3-0.6b")) == "dummy"
    assert "RANDOM weights" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert _load_format(EngineConfig(model="qwen3-0.6b", load_format="dummy")) == "dummy"
    assert caplog.text == ""
