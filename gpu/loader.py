"""Loading a model from a local Hugging Face directory (never the network).

Reads config.json (its family parses it: gpu/models/) and the weights in
``*.safetensors`` (one file, or shards listed by model.safetensors.index.json),
maps checkpoint tensor names onto the model's fused parameters (the family's
weight map, gpu/models/weights.py), and checks every shape before copying. Any problem is
one ModelLoadError naming the file and what is wrong; a model is returned only
once every parameter was filled.

``load_format="dummy"`` fills the same architecture with seeded random weights
from config.json alone, for benchmarks.

FP8 (gpu/quantization.py): an e4m3 checkpoint tensor is read with its scale tensor
and dequantized as it is read; a tensor of any other dtype is read as it is (a layer
the checkpoint left unquantized). An e4m3 tensor in a checkpoint whose config.json
does not say how it is scaled is refused. ``quantization="fp8"`` (online) rounds each
linear weight to e4m3 with per-row scales as it is read, before it is sharded. On a
GPU with FP8 tensor cores the projections keep the e4m3 values and their scales
instead (gpu/fp8_weights.py says which), for the FP8 GEMMs.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open

from trio_llm.gpu import fp8_weights
from trio_llm.gpu.models import CausalLM, ModelLoadError, read_model_config
from trio_llm.gpu.models.weights import Target, copy_into
from trio_llm.gpu.quantization import (
    E4M3,
    ONLINE_METHODS,
    SAFETENSORS_E4M3,
    SAFETENSORS_FLOAT8,
    CheckpointQuantization,
    Fp8Weight,
    KVScales,
    check_kv_cache_device,
    checkpoint_fp8_weight,
    is_quantizable,
    kv_cache_dtype,
    kv_scale_names,
    quantize_blocks,
    quantize_rows,
    scale_name,
)
from trio_llm.gpu.tensor_parallel import TensorParallel

__all__ = ["ModelLoadError", "fill_dummy_weights", "load_model", "resolve_device",
           "resolve_dtype"]

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
               parallel: TensorParallel | None = None,
               quantization: str | None = None, kv_cache: str = "auto") -> CausalLM:
    """Build the model described by ``directory``/config.json and fill its weights
    (with ``parallel``, this rank's shard only: it reads no other rank's part);
    ``quantization="fp8"``: its linear weights rounded to e4m3 (online FP8);
    ``kv_cache="fp8"``: an e4m3 KV cache, with the checkpoint's scales if it has
    them."""
    config = read_model_config(directory)
    check_online_quantization(quantization, config.quantization, directory)
    cache_dtype = kv_cache_dtype(kv_cache, dtype)
    check_kv_cache_device(cache_dtype, device)
    with torch.no_grad():
        model = CausalLM(config, dtype=dtype, device=device, max_positions=max_positions,
                         parallel=parallel, kv_cache_dtype=cache_dtype)
        online = quantization is not None
        layout = fp8_weights.fp8_layout(model, config.quantization, online)
        if load_format == "dummy":
            if layout is not None:
                fp8_weights.keep_fp8(model, layout, model.checkpoint_targets(), None)
            fill_dummy_weights(model, fp8=online or config.quantization is not None,
                               fp8_block_size=layout.block_size if layout else None)
        elif load_format in ("auto", "safetensors"):
            if layout is not None:
                dtypes = (None if online
                          else fp8_weights.checkpoint_dtypes(checkpoint_files(directory)))
                fp8_weights.keep_fp8(model, layout, model.checkpoint_targets(), dtypes)
            _load_safetensors(model, directory, online=online)
            if cache_dtype == E4M3:
                _load_kv_scales(model, directory)
        else:
            raise ModelLoadError(f"unsupported load_format {load_format!r}")
    return model.eval()


def check_online_quantization(method: str | None, checkpoint: CheckpointQuantization | None,
                              directory: Path) -> None:
    """``--quantization``: a method trio-llm has, for a checkpoint not quantized already."""
    if method is None:
        return
    if method not in ONLINE_METHODS:
        raise ModelLoadError(f"quantization {method!r} is not supported; supported: "
                             f"{', '.join(ONLINE_METHODS)}")
    if checkpoint is not None:
        raise ModelLoadError(f"{directory}: --quantization {method} quantizes an unquantized "
                             f"checkpoint, and this one is quantized already (quantization_config "
                             f"{checkpoint.method!r}): leave --quantization out")


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


def _load_safetensors(model: CausalLM, directory: Path, *, online: bool) -> None:
    targets = model.checkpoint_targets()
    parameters = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    decoder = _WeightDecoder(directory, model.config.quantization, online=online,
                             fp8_parameters={name for name, parameter in parameters.items()
                                             if parameter.dtype == E4M3})
    for tensor_name, tensor in _read_tensors(directory, targets, decoder):
        if isinstance(tensor, Fp8Weight):
            fp8_weights.copy_fp8_into(parameters, targets[tensor_name], tensor)
        else:
            copy_into(parameters, targets[tensor_name], tensor)
        loaded.add(tensor_name)
    missing = [name for name in targets if name not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise ModelLoadError(f"{directory}: missing tensor(s) in the checkpoint: {shown}")


def _read_tensors(directory: Path, targets: dict[str, Target], decoder: _WeightDecoder
                  ) -> Iterator[tuple[str, torch.Tensor | Fp8Weight]]:
    """Yield every needed tensor with its name, checking its shape before reading its data."""
    for path, indexed_names in checkpoint_files(directory).items():
        try:
            with safe_open(str(path), framework="pt", device="cpu") as file:
                names = indexed_names if indexed_names is not None else list(file.keys())
                for name in names:
                    parts: list[tuple[str, ExpertPart | None]] = [(name, None)]
                    if name not in targets:
                        parts = list(_expert_parts(name, targets))
                    if not parts:
                        continue  # e.g. rotary inv_freq buffers, or lm_head when tied
                    if name not in file.keys():
                        raise ModelLoadError(f"{path}: missing tensor {name} "
                                             f"(the index says it is in this file)")
                    for part_name, part in parts:
                        tensor_slice = file.get_slice(name)
                        if part is not None:  # one expert's rows of a 3-D tensor
                            tensor_slice = _ExpertSlice(path, name, tensor_slice, part)
                        _check_shape(path, part_name, tensor_slice.get_shape(),
                                     targets[part_name])
                        # only this rank's shard is read from the file
                        yield part_name, decoder.take(path, part_name, tensor_slice,
                                                      targets[part_name])
        except ModelLoadError:
            raise
        except Exception as error:  # safetensors raises its own types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({error})") from error


# Checkpoints that store each layer's experts as two 3-D tensors (Qwen3.5-MoE's, as
# transformers holds them: ``experts.gate_up_proj`` [experts, 2 x intermediate, hidden],
# an expert's gate rows then its up rows, and ``experts.down_proj`` [experts, hidden,
# intermediate]) are read as the per-expert tensors the families name, which is how
# transformers writes and converts them (vLLM reads both forms too).
FUSED_EXPERT_PARTS = {"experts.gate_up_proj": ("gate_proj", "up_proj"),
                      "experts.down_proj": ("down_proj",)}


class ExpertPart(NamedTuple):
    """One expert's tensor in a fused 3-D experts tensor of ``num_experts`` experts and
    ``fused_rows`` rows each: its ``rows`` rows from ``first_row``."""

    expert: int
    first_row: int
    rows: int
    num_experts: int
    fused_rows: int


def _expert_parts(name: str, targets: dict[str, Target]) -> list[tuple[str, ExpertPart]]:
    """For a fused 3-D experts tensor the model reads per expert: each expert's tensor
    name and where it is in the 3-D tensor; [] for any other name."""
    prefix, separator, fused = name.rpartition("experts.")
    kinds = FUSED_EXPERT_PARTS.get(separator + fused)
    first = f"{prefix}experts.0.{kinds[0]}.weight" if kinds else ""
    if kinds is None or first not in targets:
        return []
    num_experts = 0
    while f"{prefix}experts.{num_experts}.{kinds[0]}.weight" in targets:
        num_experts += 1
    rows = targets[first].shape[0]
    return [(f"{prefix}experts.{expert}.{kind}.weight",
             ExpertPart(expert, index * rows, rows, num_experts, len(kinds) * rows))
            for expert in range(num_experts) for index, kind in enumerate(kinds)]


class _ExpertSlice:
    """One expert's rows of a fused 3-D experts tensor, with the part of a safetensors
    slice's interface the loader reads (its dtype and shape, then its rows)."""

    def __init__(self, path: Path, name: str, fused: Any, part: ExpertPart) -> None:
        if fused.get_dtype() in SAFETENSORS_FLOAT8:
            raise ModelLoadError(f"{path}: tensor {name} holds FP8 experts in one 3-D tensor, "
                                 f"which trio-llm does not read (one tensor an expert, as "
                                 f"Qwen's FP8 releases store them, it does)")
        shape = fused.get_shape()
        if len(shape) != 3 or shape[:2] != [part.num_experts, part.fused_rows]:
            raise ModelLoadError(f"{path}: shape mismatch for tensor {name}: expected "
                                 f"[{part.num_experts}, {part.fused_rows}, ...] (experts, "
                                 f"rows), found {shape}")
        self._fused, self._part = fused, part
        self._shape = [part.rows, shape[2]]

    def get_dtype(self) -> str:
        return self._fused.get_dtype()

    def get_shape(self) -> list[int]:
        return self._shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        part = self._part
        rows = self._fused[part.expert:part.expert + 1,
                           part.first_row:part.first_row + part.rows][0]
        return rows[index]


def _check_shape(path: Path, name: str, shape: list[int], target: Target) -> None:
    if tuple(shape) != target.shape:
        raise ModelLoadError(f"{path}: shape mismatch for tensor {name}: "
                             f"expected {list(target.shape)}, found {list(shape)}")


class _WeightDecoder:
    """Reads a checkpoint tensor's part for its target: an e4m3 weight dequantized with
    its scale (found in whichever file holds it), a float weight rounded to e4m3 for
    online FP8, anything else as it is; for a parameter kept in e4m3
    (``fp8_parameters``), the Fp8Weight itself."""

    def __init__(self, directory: Path, quantization: CheckpointQuantization | None, *,
                 online: bool, fp8_parameters: set[str]) -> None:
        self.directory = directory
        self.quantization = quantization
        self.online = online
        self.fp8_parameters = fp8_parameters
        self._files_by_name: dict[str, Path] | None = None

    def take(self, path: Path, name: str, tensor_slice: Any, target: Target
             ) -> torch.Tensor | Fp8Weight:
        if target.parameter_name in self.fp8_parameters:
            weight = self._fp8_weight(name, tensor_slice)
            return weight.take_rows(target.pieces) if target.pieces else weight
        dtype = tensor_slice.get_dtype()
        if dtype in SAFETENSORS_FLOAT8:
            if self.quantization is None or dtype != SAFETENSORS_E4M3:
                raise ModelLoadError(
                    f"{path}: tensor {name} is {dtype}, and config.json's quantization_config "
                    f"does not say how it is scaled (trio-llm reads e4m3 weights of the "
                    f"formats gpu/quantization.py names)")
            scale = self._read(scale_name(self.quantization, name))
            weight = checkpoint_fp8_weight(self.quantization, name, tensor_slice[:], scale)
            return target.take(weight.dequantize())  # whole, then this rank's shard
        if self.online and is_quantizable(target.parameter_name):
            return target.take(quantize_rows(tensor_slice[:]).dequantize())
        return target.take(tensor_slice)

    def _fp8_weight(self, name: str, tensor_slice: Any) -> Fp8Weight:
        """A tensor for a parameter kept in e4m3 (one rank: gpu/fp8_weights.py), whole: the
        checkpoint's values and scale, or the float weight rounded per row (online)."""
        if self.online:
            return quantize_rows(tensor_slice[:])
        assert self.quantization is not None and tensor_slice.get_dtype() == SAFETENSORS_E4M3
        scale = self._read(scale_name(self.quantization, name))
        return checkpoint_fp8_weight(self.quantization, name, tensor_slice[:], scale)

    def _read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` from whichever checkpoint file holds it."""
        if self._files_by_name is None:
            self._files_by_name = {}
            for file_path, names in checkpoint_files(self.directory).items():
                if names is None:
                    with safe_open(str(file_path), framework="pt", device="cpu") as file:
                        names = list(file.keys())
                self._files_by_name |= dict.fromkeys(names, file_path)
        found = self._files_by_name.get(name)
        if found is None:
            raise ModelLoadError(f"{self.directory}: missing tensor {name} (the scale of an "
                                 f"FP8 weight) in the checkpoint")
        with safe_open(str(found), framework="pt", device="cpu") as file:
            return file.get_tensor(name)


def _load_kv_scales(model: CausalLM, directory: Path) -> None:
    """Each attention layer's FP8 KV cache scales from the checkpoint (``k_scale``/
    ``v_scale``, or one ``kv_scale``), where it has them; a layer without keeps 1.0, as
    vLLM's does (a linear-attention layer has no KV cache)."""
    names: dict[str, Path] = {}
    for path, indexed_names in checkpoint_files(directory).items():
        with safe_open(str(path), framework="pt", device="cpu") as file:
            names |= dict.fromkeys(indexed_names if indexed_names is not None
                                   else file.keys(), path)
    for index, layer in enumerate(model.decoder_layers):
        if layer.linear_attn is not None:
            continue
        k_name, v_name, kv_name = kv_scale_names(index, model.config.weight_prefix)
        k_scale = _read_scale(names, k_name) or _read_scale(names, kv_name) or 1.0
        v_scale = _read_scale(names, v_name) or _read_scale(names, kv_name) or 1.0
        layer.self_attn.kv_scales = KVScales(k_scale, v_scale)


def _read_scale(files_by_name: dict[str, Path], name: str) -> float | None:
    """Scalar tensor ``name`` (a KV cache scale), None where the checkpoint lacks it."""
    path = files_by_name.get(name)
    if path is None:
        return None
    with safe_open(str(path), framework="pt", device="cpu") as file:
        tensor = file.get_tensor(name)
    if tensor.numel() != 1:
        raise ModelLoadError(f"{path}: tensor {name} (a KV cache scale) must hold one value, "
                             f"found shape {list(tensor.shape)}")
    scale = float(tensor.to(torch.float32))
    if not scale > 0 or scale == float("inf"):
        raise ModelLoadError(f"{path}: tensor {name} (a KV cache scale) must be positive and "
                             f"finite, found {scale}")
    return scale


# -- dummy weights -------------------------------------------------------------------


def fill_dummy_weights(model: CausalLM, *, seed: int = DUMMY_SEED, std: float = DUMMY_STD,
                       fp8: bool = False, fp8_block_size: tuple[int, int] | None = None
                       ) -> None:
    """Seeded random weights: norms at one, biases at zero, everything else normal with a
    small std. Each checkpoint tensor is drawn whole, in one order, then sharded as a
    checkpoint would be: every tensor-parallel size gets the same model. ``fp8``: the
    linear weights rounded to e4m3 with per-row scales."""
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
            if parameters[target.parameter_name].dtype == E4M3:  # kept in e4m3
                fp8_weights.copy_fp8_into(parameters, target,
                                          quantize_rows(tensor) if fp8_block_size is None
                                          else quantize_blocks(tensor, fp8_block_size))
                continue
            if fp8 and is_quantizable(target.parameter_name):
                tensor = quantize_rows(tensor).dequantize()
        copy_into(parameters, target, target.take(tensor))
