"""Loading a model from a local Hugging Face directory (never the network).

Reads config.json and the weights in ``*.safetensors`` (one file, or shards
listed by model.safetensors.index.json), maps checkpoint tensor names onto the
model's fused parameters, and checks every shape before copying. Any problem is
one ModelLoadError naming the file and what is wrong; a model is returned only
once every parameter was filled.

``load_format="dummy"`` fills the same architecture with seeded random weights
from config.json alone, for benchmarks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trio_llm.gpu.config import ModelConfig, ModelLoadError
from trio_llm.gpu.model import CausalLM
from trio_llm.gpu.tensor_parallel import TensorParallel

__all__ = ["ModelLoadError", "load_model", "resolve_device", "resolve_dtype"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DUMMY_SEED = 0
DUMMY_STD = 0.02


def resolve_device(name: str) -> torch.device:
    """"auto" is CUDA where available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto" is float32 on the CPU and bfloat16 on CUDA."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(directory: Path, *, dtype: torch.dtype, device: torch.device,
               load_format: str = "auto", max_positions: int | None = None,
               parallel: TensorParallel | None = None) -> CausalLM:
    """Build the model described by ``directory``/config.json and fill its weights
    (with ``parallel``, this rank's shard only: it reads no other rank's part)."""
    config = ModelConfig.from_dir(directory)
    with torch.no_grad():
        model = CausalLM(config, dtype=dtype, device=device, max_positions=max_positions,
                         parallel=parallel)
        if load_format == "dummy":
            fill_dummy_weights(model)
        elif load_format in ("auto", "safetensors"):
            _load_safetensors(model, directory)
        else:
            raise ModelLoadError(f"unsupported load_format {load_format!r}")
    return model.eval()


# -- checkpoint names -> parameters --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor goes: rows ``[row_start, row_start + num_rows)`` of a
    model parameter (a fused parameter holds several checkpoint tensors).

    ``shape`` is the checkpoint tensor's, checked before its data is read. Under tensor
    parallelism a rank reads only its shard: ``shard_length`` entries from
    ``shard_start`` along ``shard_dim`` (None: the whole tensor). A vocabulary shard may
    reach past the tensor's end: the rows past it are padding and get zeros.
    ``is_zero``: the bias of a row-parallel layer on a rank other than 0, whose partial
    sums must not add it a second time.
    """

    parameter_name: str
    row_start: int
    num_rows: int
    shape: tuple[int, ...]
    shard_dim: int | None = None
    shard_start: int = 0
    shard_length: int = 0
    is_zero: bool = False

    def take(self, tensor: Any) -> Any:
        """This rank's part of ``tensor`` (a torch tensor or a safetensors slice)."""
        if self.shard_dim is None:
            return tensor[:]
        end = min(self.shard_start + self.shard_length, self.shape[self.shard_dim])
        if self.shard_dim == 0:
            return tensor[self.shard_start:end]
        return tensor[:, self.shard_start:end]


def checkpoint_targets(model: CausalLM) -> dict[str, Target]:
    """Every checkpoint tensor name the model needs, and where it goes (for this rank's
    shard of a tensor-parallel model)."""
    config = model.config
    parallel = model.parallel
    parameters = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[str, Target] = {}

    def whole(checkpoint_name: str, parameter_name: str) -> None:
        shape = tuple(parameters[parameter_name].shape)
        targets[checkpoint_name] = Target(parameter_name, 0, shape[0], shape)

    def vocabulary(checkpoint_name: str, parameter_name: str) -> None:
        shape = (config.vocab_size, config.hidden_size)
        targets[checkpoint_name] = Target(parameter_name, 0, model.num_vocab_rows, shape,
                                          shard_dim=0, shard_start=model.vocab_start,
                                          shard_length=model.num_vocab_rows)

    def column_parallel(prefix: str, parameter_name: str, parts: list[tuple[str, int, str]],
                        suffix: str) -> None:
        """Fused parts, each split by output rows: this rank's rows of each, stacked."""
        parameter_shape = tuple(parameters[parameter_name].shape)
        row_start = 0
        for part_name, num_rows, what in parts:
            shard_start, shard_length = parallel.split(num_rows, what)
            shape = (num_rows, *parameter_shape[1:])
            targets[f"{prefix}{part_name}.{suffix}"] = Target(
                parameter_name, row_start, shard_length, shape, shard_dim=0,
                shard_start=shard_start, shard_length=shard_length)
            row_start += shard_length

    def row_parallel(checkpoint_name: str, parameter_name: str, num_inputs: int,
                     what: str) -> None:
        """A weight split by input columns; its bias is added by rank 0 alone."""
        parameter_shape = tuple(parameters[parameter_name].shape)
        if checkpoint_name.endswith(".bias"):
            targets[checkpoint_name] = Target(parameter_name, 0, parameter_shape[0],
                                              parameter_shape, is_zero=parallel.rank != 0)
            return
        shard_start, shard_length = parallel.split(num_inputs, what)
        targets[checkpoint_name] = Target(parameter_name, 0, parameter_shape[0],
                                          (parameter_shape[0], num_inputs), shard_dim=1,
                                          shard_start=shard_start, shard_length=shard_length)

    vocabulary("model.embed_tokens.weight", "embed_tokens")
    whole("model.norm.weight", "norm.weight")
    if not config.tie_word_embeddings:
        vocabulary("lm_head.weight", "lm_head.weight")
    heads, kv_heads = "the number of attention heads", "the number of KV heads"
    intermediate = "the intermediate size"
    # Each part's rows are whole heads (or intermediate units): split them by those.
    qkv_parts = [("q_proj", config.q_size, heads), ("k_proj", config.kv_size, kv_heads),
                 ("v_proj", config.kv_size, kv_heads)]
    gate_up_parts = [("gate_proj", config.intermediate_size, intermediate),
                     ("up_proj", config.intermediate_size, intermediate)]
    qkv_suffixes = ("weight", "bias") if config.qkv_bias else ("weight",)
    mlp_suffixes = ("weight", "bias") if config.mlp_bias else ("weight",)
    o_proj_suffixes = ("weight", "bias") if config.o_proj_bias else ("weight",)
    # Per-layer tensors every rank holds whole, named as in the checkpoint less "model.".
    same_names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
    same_names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if config.qk_norm else []
    for index in range(config.num_layers):
        ours, theirs = f"layers.{index}.", f"model.layers.{index}."
        for suffix in qkv_suffixes:
            column_parallel(theirs + "self_attn.", ours + f"self_attn.qkv_proj.{suffix}",
                            qkv_parts, suffix)
        for suffix in mlp_suffixes:
            column_parallel(theirs + "mlp.", ours + f"mlp.gate_up_proj.{suffix}",
                            gate_up_parts, suffix)
            row_parallel(theirs + f"mlp.down_proj.{suffix}", ours + f"mlp.down_proj.{suffix}",
                         config.intermediate_size, intermediate)
        for suffix in o_proj_suffixes:
            row_parallel(theirs + f"self_attn.o_proj.{suffix}",
                         ours + f"self_attn.o_proj.{suffix}", config.q_size, heads)
        for name in same_names:
            whole(theirs + name, ours + name)
    return targets


def copy_into(parameters: Mapping[str, torch.Tensor], target: Target,
              part: torch.Tensor) -> None:
    """Copy this rank's ``part`` of a checkpoint tensor into its rows of the parameter;
    padding rows past the part's end get zeros."""
    destination = parameters[target.parameter_name][target.row_start:
                                                    target.row_start + target.num_rows]
    if target.is_zero:
        destination.zero_()
        return
    destination[:part.shape[0]].copy_(part)
    destination[part.shape[0]:].zero_()


# -- safetensors ---------------------------------------------------------------------


def checkpoint_files(directory: Path) -> dict[Path, list[str] | None]:
    """The safetensors files to read, each with the tensor names the index assigns it
    (None: read whatever the file holds)."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        return _indexed_files(index_path)
    single = directory / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise ModelLoadError(
            f"{directory}: missing file: no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors "
            f"(use load_format='dummy' for random weights)")
    return dict.fromkeys(found)


def _indexed_files(index_path: Path) -> dict[Path, list[str] | None]:
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"{index_path}: malformed index ({error!r})") from error
    names_by_file: defaultdict[Path, list[str]] = defaultdict(list)
    for tensor_name, file_name in weight_map.items():
        names_by_file[index_path.parent / file_name].append(tensor_name)
    for path in names_by_file:
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing file (listed in {index_path.name})")
    return dict(names_by_file)


def _load_safetensors(model: CausalLM, directory: Path) -> None:
    targets = checkpoint_targets(model)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for tensor_name, tensor in _read_tensors(directory, targets):
        copy_into(parameters, targets[tensor_name], tensor)
        loaded.add(tensor_name)
    missing = [name for name in targets if name not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ModelLoadError(f"{directory}: missing tensor(s) in the checkpoint: {shown}")


def _read_tensors(directory: Path, targets: dict[str, Target]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every needed tensor with its name, checking its shape before reading its data."""
    for path, indexed_names in checkpoint_files(directory).items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as file:
                names = indexed_names if indexed_names is not None else list(file.keys())
                for name in names:
                    if name not in targets:
                        continue  # e.g. rotary inv_freq buffers, or lm_head when tied
                    if name not in file.keys():
                        raise ModelLoadError(f"{path}: missing tensor {name} "
                                             f"(the index says it is in this file)")
                    tensor_slice = file.get_slice(name)
                    _check_shape(path, name, tensor_slice.get_shape(), targets[name])
                    # only this rank's shard is read from the file
                    yield name, targets[name].take(tensor_slice)
        except ModelLoadError:
            raise
        except Exception as error:  # safetensors raises its own types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({error})") from error


def _check_shape(path: Path, name: str, shape: list[int], target: Target) -> None:
    if tuple(shape) != target.shape:
        raise ModelLoadError(f"{path}: shape mismatch for tensor {name}: "
                             f"expected {list(target.shape)}, found {list(shape)}")


# -- dummy weights -------------------------------------------------------------------


def fill_dummy_weights(model: CausalLM, *, seed: int = DUMMY_SEED, std: float = DUMMY_STD) -> None:
    """Seeded random weights: norms at one, biases at zero, everything else normal with a
    small std. Each checkpoint tensor is drawn whole, in one order, then sharded as a
    checkpoint would be: every tensor-parallel size gets the same model."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, target in checkpoint_targets(model).items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(target.shape, device=model.device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(target.shape, device=model.device)
        else:
            tensor = torch.randn(target.shape, generator=generator, device=model.device,
                                 dtype=torch.float32).mul_(std)
        copy_into(parameters, target, target.take(tensor))
