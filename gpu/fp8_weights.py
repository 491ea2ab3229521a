"""Which projections of an FP8 model stay e4m3 on the device, and filling them.

On a GPU with FP8 tensor cores, an FP8 model's projections become Fp8Linear layers
(gpu/layers/fp8_linear.py) before any weight is read, and the loader copies each
checkpoint tensor's e4m3 values and scales into them unchanged (``copy_fp8_into``);
everything else is loaded as before (dequantized, or as it is). A projection stays a
dequantized float layer where the FP8 kernels cannot take it:

- on the CPU, or a GPU before Hopper (the row-wise ``torch._scaled_mm`` needs sm90, and
  writes bf16 only: per-channel FP8 needs a bf16 model);
- under tensor parallelism (shards of block scales are not written yet);
- a checkpoint that left one of the projection's tensors unquantized (an ``ignore``d
  layer is served at the checkpoint's precision, as vLLM serves it);
- shapes the kernels do not take: per-channel GEMMs need both sizes a multiple of 16,
  block scales need every fused part (q/k/v, gate/up) to start on a block boundary, the
  row ranges a checkpoint interleaves (Qwen3-Next's q/k/v/z) to span whole blocks, and
  a power-of-two block width of at least 16.

The MoE families' stacked experts stay e4m3 too, with the same scales per expert
(the fused MoE kernel widens them in-kernel: gpu/kernels/fused_moe.py), under the same
conditions (the up rows start on a block boundary).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from trio_llm.gpu.layers.fp8_linear import Fp8Layout, to_fp8_linear
from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.layers.moe import SparseMoeBlock
from trio_llm.gpu.models import CausalLM
from trio_llm.gpu.models.weights import Target
from trio_llm.gpu.quantization import (
    CheckpointQuantization,
    Fp8Weight,
    is_quantizable,
    keeps_fp8_weights,
)

# The row-wise torch._scaled_mm (per-channel) and Triton's FP8 dots (blocks).
MIN_CAPABILITY = {"channel": (9, 0), "block": (8, 9)}
SCALED_MM_MULTIPLE = 16
MIN_BLOCK_COLUMNS = 16


def fp8_layout(model: CausalLM, checkpoint: CheckpointQuantization | None,
               online: bool) -> Fp8Layout | None:
    """The layout an FP8 model's projections keep on its device; None: dequantize."""
    if (checkpoint is None and not online) or not keeps_fp8_weights(
            model.device, model.parallel.is_parallel):
        return None
    block_size = checkpoint.block_size if checkpoint is not None else None
    kind = "channel" if block_size is None else "block"
    if model.device.type == "cuda" and \
            torch.cuda.get_device_capability(model.device) < MIN_CAPABILITY[kind]:
        return None
    if model.device.type == "cuda" and kind == "channel" and model.dtype != torch.bfloat16:
        return None  # the row-wise torch._scaled_mm writes bf16 only
    if block_size is not None and (block_size[1] < MIN_BLOCK_COLUMNS
                                   or block_size[1] & (block_size[1] - 1)):
        return None
    return Fp8Layout(block_size)


def keep_fp8(model: CausalLM, layout: Fp8Layout, targets: Mapping[str, Target],
             checkpoint_dtypes: Mapping[str, str] | None) -> list[str]:
    """Make every projection the kernels can take an Fp8Linear (see the module); returns
    the names of the e4m3 parameters. ``checkpoint_dtypes``: each checkpoint tensor's
    safetensors dtype (None: dummy or online weights, all quantized)."""
    parts: dict[str, list[tuple[str, Target]]] = {}
    for name, target in targets.items():
        parts.setdefault(target.parameter_name, []).append((name, target))
    kept = []
    for module_name, module in list(model.named_modules()):
        parameter_name = module_name + ".weight"
        if (type(module) is Linear and is_quantizable(parameter_name)
                and _fits(module.weight.shape, layout, parts.get(parameter_name, []),
                          checkpoint_dtypes)):
            to_fp8_linear(module, layout)
            kept.append(parameter_name)
        if isinstance(module, SparseMoeBlock):
            names = [f"{module_name}.experts_gate_up", f"{module_name}.experts_down"]
            if all(_fits(None, layout, parts.get(name, []), checkpoint_dtypes)
                   for name in names):
                module.keep_experts_fp8(layout.block_size)
                kept += names
    return kept


def _fits(shape: torch.Size | None, layout: Fp8Layout, parts: Iterable[tuple[str, Target]],
          checkpoint_dtypes: Mapping[str, str] | None) -> bool:
    """Whether the checkpoint tensors ``parts`` of one parameter (a Linear's weight of
    ``shape``, or stacked experts: None) can stay e4m3 for the kernels."""
    parts = list(parts)
    if not parts:
        return False
    if checkpoint_dtypes is not None and any(checkpoint_dtypes.get(name) != "F8_E4M3"
                                             for name, _ in parts):
        return False  # a tensor the checkpoint left unquantized
    if layout.block_size is None:
        return shape is None or (shape[0] % SCALED_MM_MULTIPLE == 0
                                 and shape[1] % SCALED_MM_MULTIPLE == 0)
    block_rows = layout.block_size[0]
    return all(target.row_start % block_rows == 0 and _pieces_on_blocks(target, block_rows)
               for _, target in parts)


def _pieces_on_blocks(target: Target, block_rows: int) -> bool:
    """Whether the row ranges ``target`` stacks (``Target.pieces``, e.g. Qwen3-Next's
    q/k/v/z rows, interleaved by head group in the checkpoint) take their block scales
    with them: each starts on a block and spans whole blocks, but for a last one that
    ends the tensor (its partial block)."""
    num_rows = target.shape[0]
    for index, (start, length) in enumerate(target.pieces):
        ends_the_tensor = index == len(target.pieces) - 1 and start + length == num_rows
        if start % block_rows or (length % block_rows and not ends_the_tensor):
            return False
    return True


def copy_fp8_into(parameters: Mapping[str, torch.Tensor], target: Target,
                  weight: Fp8Weight) -> None:
    """Copy a checkpoint tensor's e4m3 values and scales into its rows of an Fp8Linear's
    ``weight`` and ``weight_scale`` (or of an expert's stacked weight and its
    ``_scale``); a per-tensor scale becomes one per row."""
    values = parameters[target.parameter_name]
    scales = parameters[target.parameter_name + "_scale"]
    if target.expert is not None:  # stacked experts: this expert's weight and scales
        values, scales = values[target.expert], scales[target.expert]
    rows = slice(target.row_start, target.row_start + target.num_rows)
    values[rows].copy_(weight.values)
    if weight.block_size is None:
        scales[rows].copy_(weight.scale.reshape(-1, 1).expand(target.num_rows, 1))
        return
    block_rows = weight.block_size[0]
    first = target.row_start // block_rows
    scales[first:first + weight.scale.shape[0]].copy_(weight.scale)


def checkpoint_dtypes(files: Mapping[Path, list[str] | None]) -> dict[str, str]:
    """Every checkpoint tensor's safetensors dtype, read from the files' headers."""
    from safetensors import safe_open

    dtypes: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as file:
            for name in file.keys():
                dtypes[name] = file.get_slice(name).get_dtype()
    return dtypes
