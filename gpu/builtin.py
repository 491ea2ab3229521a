"""Built-in model names, materialised on first use into a local cache, with no network.

``tiny`` is a small Qwen3-architecture model with a real byte-level BPE tokenizer
(trained on gpu/tiny_corpus.py), a ChatML chat template and random weights from a
fixed seed: small enough that the whole engine runs fast on a CPU, real enough
that text goes in and text comes out. ``tiny-moe`` is the same with Qwen3-MoE
layers (8 experts, top 2): the Mixture-of-Experts path end to end on a CPU.
``qwen3-0.6b``, ``qwen3-8b``, ``qwen3-30b-a3b`` (Qwen3-MoE: 128 experts, top 8),
``qwen3-8b-fp8`` and ``qwen3-30b-a3b-fp8`` (the same with the quantization_config of
Qwen's FP8 releases: e4m3 weights in 128 x 128 blocks) and ``qwen3-moe-small`` (a
Qwen3-MoE shape for CPU benchmarks), and the hybrid family's ``qwen3.5-27b``,
``qwen3.5-35b-a3b`` (Qwen3.5's published dimensions; ``-fp8`` each: with that
quantization_config) and ``qwen3.5-small`` (its shape, small, for CPU benchmarks and
tests) carry configurations for ``load_format="dummy"``
(random weights, no safetensors written): they measure speed, not quality.

A built model directory is written to a temporary directory and renamed into
place, so processes that start at the same time never see half a model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers

from trio_llm.gpu.tiny_corpus import TINY_CORPUS

logger = logging.getLogger(__name__)

# Bump when anything below changes what a built-in directory contains.
BUILTIN_VERSION = 2
MARKER_FILE = "trio-llm-builtin.json"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_VOCAB_SIZE = 2048
TINY_SEED = 20241
# Embedding entries of this std make the tied lm_head's logits spread by about
# 5 units, so greedy choices are decided by wide margins (no near-ties).
TINY_EMBEDDING_STD = 0.6
# Layers write into the residual stream this many times louder than a plain
# 1/sqrt(fan_in) init would: otherwise the last token's embedding dominates and
# greedy output repeats one token forever.
TINY_RESIDUAL_GAIN = 8.0

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "dtype": "float32",
}

TINY_MOE_CONFIG: dict[str, Any] = TINY_CONFIG | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_0_6B_CONFIG: dict[str, Any] = QWEN3_COMMON | {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}

QWEN3_8B_CONFIG: dict[str, Any] = QWEN3_COMMON | {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}


# Qwen3-30B-A3B's published configuration (3.3B of its 30.5B parameters active a token).
QWEN3_30B_A3B_CONFIG: dict[str, Any] = QWEN3_COMMON | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_window_layers": 48,
    "tie_word_embeddings": False,
}

# A small Qwen3-MoE for CPU benchmarks: Qwen3-30B-A3B's shape of routing (top 8 of
# many experts), a few layers of a small hidden size.
QWEN3_MOE_SMALL_CONFIG: dict[str, Any] = QWEN3_COMMON | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "moe_intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 32768,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """The model directory for a path, a built-in name (built if needed) or a Hugging
    Face id ``ORG/NAME`` found in the local Hugging Face cache (never downloaded)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    builder = BUILTIN_MODELS.get(name_or_path)
    if builder is not None:
        return _materialise(name_or_path, builder)
    if _is_repo_id(name_or_path):
        return _from_hugging_face_cache(name_or_path, revision)
    raise ValueError(
        f"model {name_or_path!r} is neither a directory, a built-in model nor a Hugging Face "
        f"id (ORG/NAME); built-in models: {', '.join(BUILTIN_MODELS)}"
    )


def _is_repo_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _from_hugging_face_cache(repo_id: str, revision: str | None) -> Path:
    """A snapshot already in the local cache; trio-llm never reaches the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as error:
        at = f" at revision {revision!r}" if revision else ""
        raise ValueError(
            f"model {repo_id!r}{at} is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; set HF_HUB_CACHE or HF_HOME to look elsewhere). "
            f"trio-llm never downloads: fetch it first, e.g. `hf download {repo_id}`, "
            f"or pass the model's directory ({type(error).__name__})"
        ) from None


def is_dummy_only(name: str) -> bool:
    """Built-in models with no weights on disk: they load with load_format="dummy" only."""
    return name in DUMMY_ONLY_CONFIGS


def cache_root() -> Path:
    """Where built-in models are materialised: $TRIO_LLM_CACHE, else ~/.cache/trio-llm."""
    override = os.environ.get("TRIO_LLM_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "trio-llm"


# -- the cache -------------------------------------------------------------------


def _materialise(name: str, builder: Callable[[Path], None]) -> Path:
    target = cache_root() / name
    if _is_complete(target, name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    # Building tiny trains a tokenizer (a few seconds): say so, or the first run looks hung.
    logger.info("building the built-in model %r in %s (first use only)", name, target)
    try:
        builder(staging)
        _make_readable(staging)
        _write_json(staging / MARKER_FILE, {"name": name, "version": BUILTIN_VERSION})
        _move_into_place(staging, target, name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(directory: Path, name: str) -> bool:
    marker = directory / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        found = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(found == {"name": name, "version": BUILTIN_VERSION})


def _move_into_place(staging: Path, target: Path, name: str) -> None:
    """Rename the staging directory to ``target``; a concurrent builder may win the race."""
    if target.exists() and not _is_complete(target, name):
        # An outdated or broken copy: move it aside first (a rename is atomic).
        stale = Path(tempfile.mkdtemp(prefix=f".{name}-stale-", dir=target.parent))
        try:
            target.rename(stale / "old")
        except OSError:
            pass  # another process replaced it meanwhile
        shutil.rmtree(stale, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        if not _is_complete(target, name):
            raise


def _make_readable(directory: Path) -> None:
    """mkdtemp creates owner-only directories; a cache may be shared between users."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# -- tokenizer -------------------------------------------------------------------


def train_tiny_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer trained on the fixed corpus: the same on every machine."""
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TINY_CORPUS.splitlines(), trainer)
    assert tokenizer.get_vocab_size() == TINY_VOCAB_SIZE, "the corpus is too small for the vocab"
    return tokenizer


def _pad_vocab(tokenizer: tokenizers.Tokenizer, vocab_size: int) -> None:
    """Add filler tokens so that every id a model of ``vocab_size`` can emit decodes."""
    first_free_id = tokenizer.get_vocab_size(with_added_tokens=True)
    fillers = [AddedToken(f"<|filler_{token_id}|>", special=False, normalized=False)
               for token_id in range(first_free_id, vocab_size)]
    tokenizer.add_tokens(fillers)


def _write_tokenizer(directory: Path, tokenizer: tokenizers.Tokenizer, *,
                     model_max_length: int) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(token_id): {"content": token, "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False, "special": True}
        for token_id, token in enumerate(SPECIAL_TOKENS)
    }
    _write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
    })
    (directory / "chat_template.jinja").write_text(CHATML_TEMPLATE, encoding="utf-8")
    endoftext_id, _, im_end_id = (tokenizer.token_to_id(token) for token in SPECIAL_TOKENS)
    _write_json(directory / "generation_config.json", {
        "bos_token_id": endoftext_id,
        "eos_token_id": [im_end_id, endoftext_id],
        "pad_token_id": endoftext_id,
    })


# -- weights -----------------------------------------------------------------------


def tiny_weights(config: dict[str, Any], *, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    """Random Qwen3 weights under Hugging Face tensor names, from a fixed seed.

    Projections get std 1/sqrt(fan_in), those that write into the residual
    stream TINY_RESIDUAL_GAIN times more; norms sit near one.
    """
    generator = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    head_dim = config["head_dim"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    intermediate = config["intermediate_size"]

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator) * std

    def linear(out_features: int, in_features: int, gain: float = 1.0) -> torch.Tensor:
        return normal((out_features, in_features), gain * in_features**-0.5)

    def norm(size: int) -> torch.Tensor:
        return 1.0 + normal((size,), 0.1)

    weights = {"model.embed_tokens.weight": normal((config["vocab_size"], hidden),
                                                    TINY_EMBEDDING_STD)}
    for layer_index in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer_index}."
        if "num_experts" in config:  # Qwen3-MoE: the experts replace the MLP
            expert = config["moe_intermediate_size"]
            weights[prefix + "mlp.gate.weight"] = linear(config["num_experts"], hidden)
            for index in range(config["num_experts"]):
                weights |= {
                    f"{prefix}mlp.experts.{index}.gate_proj.weight": linear(expert, hidden),
                    f"{prefix}mlp.experts.{index}.up_proj.weight": linear(expert, hidden),
                    f"{prefix}mlp.experts.{index}.down_proj.weight": linear(
                        hidden, expert, TINY_RESIDUAL_GAIN),
                }
        else:
            weights |= {
                prefix + "mlp.gate_proj.weight": linear(intermediate, hidden),
                prefix + "mlp.up_proj.weight": linear(intermediate, hidden),
                prefix + "mlp.down_proj.weight": linear(hidden, intermediate,
                                                        TINY_RESIDUAL_GAIN),
            }
        weights |= {
            prefix + "input_layernorm.weight": norm(hidden),
            prefix + "self_attn.q_proj.weight": linear(q_size, hidden),
            prefix + "self_attn.k_proj.weight": linear(kv_size, hidden),
            prefix + "self_attn.v_proj.weight": linear(kv_size, hidden),
            prefix + "self_attn.o_proj.weight": linear(hidden, q_size, TINY_RESIDUAL_GAIN),
            prefix + "self_attn.q_norm.weight": norm(head_dim),
            prefix + "self_attn.k_norm.weight": norm(head_dim),
            prefix + "post_attention_layernorm.weight": norm(hidden),
        }
    weights["model.norm.weight"] = norm(hidden)
    return {name: tensor.contiguous() for name, tensor in weights.items()}


# -- builders ----------------------------------------------------------------------


def _tiny_builder(config: dict[str, Any]) -> Callable[[Path], None]:
    def build(directory: Path) -> None:
        """Write a tiny model: config, tokenizer, chat template, weights."""
        tokenizer = train_tiny_tokenizer()
        _write_tokenizer(directory, tokenizer,
                         model_max_length=config["max_position_embeddings"])
        _write_json(directory / "config.json", config)
        save_file(tiny_weights(config), str(directory / "model.safetensors"),
                  metadata={"format": "pt"})

    return build


build_tiny = _tiny_builder(TINY_CONFIG)


def _dummy_builder(config: dict[str, Any]) -> Callable[[Path], None]:
    def build(directory: Path) -> None:
        tokenizer = train_tiny_tokenizer()
        _pad_vocab(tokenizer, config["vocab_size"])
        _write_tokenizer(directory, tokenizer, model_max_length=config["max_position_embeddings"])
        _write_json(directory / "config.json", config)

    return build


def every_fourth_layer_full(num_layers: int) -> list[str]:
    """The hybrid family's layer_types: three linear-attention layers, then one of
    full attention (Qwen3.5's full_attention_interval 4)."""
    return ["full_attention" if (index + 1) % 4 == 0 else "linear_attention"
            for index in range(num_layers)]


QWEN3_5_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "eos_token_id": 248044,
    "head_dim": 256,
    "hidden_act": "silu",
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "vocab_size": 248320,
}

# Qwen3.5-27B's published text model (Qwen3.6-27B has the same dimensions).
QWEN3_5_27B_CONFIG: dict[str, Any] = QWEN3_5_COMMON | {
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "layer_types": every_fourth_layer_full(64),
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
}

# Qwen3.5-35B-A3B's published text model (Qwen3.6-35B-A3B's too): 256 experts, top 8,
# each expert and the gated shared expert of intermediate size 512.
QWEN3_5_35B_A3B_CONFIG: dict[str, Any] = QWEN3_5_COMMON | {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "layer_types": every_fourth_layer_full(40),
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}

# The hybrid family's shape, small, for CPU benchmarks and tests: 8 layers (two of
# full attention), linear attention of 4 key and 8 value heads.
QWEN3_5_SMALL_CONFIG: dict[str, Any] = QWEN3_5_COMMON | {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "layer_types": every_fourth_layer_full(8),
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "vocab_size": 32768,
    "eos_token_id": 2,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}

# The quantization_config of Qwen's FP8 releases (Qwen/Qwen3-8B-FP8, Qwen/Qwen3-30B-A3B-FP8,
# Qwen/Qwen3.6-27B-FP8, ...):
# e4m3 weights with one scale per 128 x 128 block, activations quantized as they come.
QWEN_FP8_BLOCKS: dict[str, Any] = {
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                            "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}

# Built-in names that carry a configuration and a tokenizer but no weights.
DUMMY_ONLY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": QWEN3_0_6B_CONFIG,
    "qwen3-8b": QWEN3_8B_CONFIG,
    "qwen3-30b-a3b": QWEN3_30B_A3B_CONFIG,
    "qwen3-moe-small": QWEN3_MOE_SMALL_CONFIG,
    "qwen3-8b-fp8": QWEN3_8B_CONFIG | QWEN_FP8_BLOCKS,
    "qwen3-30b-a3b-fp8": QWEN3_30B_A3B_CONFIG | QWEN_FP8_BLOCKS,
    "qwen3.5-27b": QWEN3_5_27B_CONFIG,
    "qwen3.5-35b-a3b": QWEN3_5_35B_A3B_CONFIG,
    "qwen3.5-27b-fp8": QWEN3_5_27B_CONFIG | QWEN_FP8_BLOCKS,
    "qwen3.5-35b-a3b-fp8": QWEN3_5_35B_A3B_CONFIG | QWEN_FP8_BLOCKS,
    "qwen3.5-small": QWEN3_5_SMALL_CONFIG,
}

BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {
    "tiny": build_tiny,
    "tiny-moe": _tiny_builder(TINY_MOE_CONFIG),
    **{name: _dummy_builder(config) for name, config in DUMMY_ONLY_CONFIGS.items()},
}
