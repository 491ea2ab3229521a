"""Loading a model from a local Hugging Face directory (never the network).

Reads config.json (its family parses it: gpu/models/) and the weights in
``*.safetensors`` (one file, or shards listed by model.safetensors.index.json),
maps checkpoint tensor names onto the model's fused parameters (the family's
weight map, gpu/models/weights.py), and checks every shape before copying. Any problem is
one ModelLoadError naming the file and what is wrong; a model is returned only
once every parameter was filled.

``load_format="dummy"`` fills the same architecture with seeded random weights
from config.json alone, for benchmarks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from trio_llm.gpu.models import CausalLM, ModelLoadError, read_model_config
from trio_llm.gpu.models.weights import Target, copy_into
from trio_llm.gpu.tensor_parallel import TensorParallel

__all__ = ["ModelLoadError", "fill_dummy_weights", "load_model", "resolve_device",
           "resolve_dtype"]

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
    config = read_model_config(directory)
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
    targets = model.checkpoint_targets()
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
    for name, target in model.checkpoint_targets().items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(target.shape, device=model.device)
        elif name.endswith(".bias"):
            tensor = torch.zeros(target.shape, device=model.device)
        else:
            tensor = torch.randn(target.shape, generator=generator, device=model.device,
                                 dtype=torch.float32).mul_(std)
        copy_into(parameters, target, target.take(tensor))
