"""FP8 weights: the checkpoint formats trio-llm reads, and ``--quantization fp8``.

A quantized checkpoint stores a linear layer's weight as e4m3 values
(``torch.float8_e4m3fn``) beside a scale tensor; the real weight is
``e4m3 value * scale``, the scale broadcast over its block, row or tensor.
config.json's ``quantization_config`` names the format:

- ``quant_method: "fp8"`` (Qwen's FP8 releases; vLLM's and transformers' "fp8"):
  ``weight_scale_inv`` with one scale per ``weight_block_size`` block
  (e.g. 128x128; the blocks at the right and bottom edges may be partial), or,
  without ``weight_block_size``, one ``weight_scale`` per tensor;
- ``quant_method: "compressed-tensors"``, format ``float-quantized`` (llm-compressor's
  FP8 and FP8_DYNAMIC): ``weight_scale`` per tensor, per output channel or per block.

``parse_quantization`` reads ``quantization_config``; anything else (AWQ, GPTQ,
bitsandbytes, MXFP4, int formats, static activation scales, an FP8 KV cache) is a
ModelLoadError naming it, so no checkpoint is ever read with its quantization ignored.

Which tensors are quantized is decided per tensor by its dtype: an e4m3 tensor is
decoded with its scale (an ``Fp8Weight``); any other tensor is a layer the checkpoint
left unquantized (``ignore``, ``modules_to_not_convert``: the lm_head, the routers).
On the CPU an Fp8Weight is dequantized once, at load, into the layer's float
parameter; activations are not quantized (FP8_DYNAMIC's per-token activation
scales change the numerics on a GPU; the CPU computes them unquantized).

``--quantization fp8`` (online) quantizes each linear weight of a float checkpoint
to e4m3 with one scale per output row, as it is read (before it is sharded, so
every tensor-parallel size gets the same weights), and on the CPU dequantizes it
again: the layer then holds exactly what an FP8 GEMM would multiply by.

``--kv-cache-dtype fp8`` (``fp8_e4m3``) keeps keys and values in e4m3: each layer
stores ``key / k_scale`` and ``value / v_scale`` (saturated at +-448) and its attention
multiplies them back on read. The scales are the checkpoint's where it has them (a
scalar ``k_scale`` and ``v_scale``, or one ``kv_scale`` for both, beside each layer's
attention, as vLLM reads them), else 1.0, as vLLM's are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from trio_llm.gpu.errors import ModelLoadError

__all__ = ["E4M3", "E4M3_MAX", "KV_CACHE_DTYPES", "CheckpointQuantization", "Fp8Activation",
           "Fp8Weight",
           "KVScales", "is_quantizable", "kv_cache_dtype", "kv_scale_names", "parse_quantization",
           "quantize_blocks", "quantize_row_groups", "quantize_rows"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
# safetensors' names of the float8 dtypes
SAFETENSORS_E4M3 = "F8_E4M3"
SAFETENSORS_FLOAT8 = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ")
ONLINE_METHODS = ("fp8",)

Strategy = Literal["tensor", "channel", "block"]

# Our parameters that hold linear weights (fused q/k/v and gate/up, o_proj, down_proj,
# the stacked experts, a shared expert); routers, the embedding and the lm_head are
# left in the model's dtype, as vLLM leaves them.
QUANTIZABLE_PARAMETER_SUFFIXES = ("_proj.weight", "experts_gate_up", "experts_down",
                                  "shared_expert_gate_up.weight", "shared_expert_down.weight")


@dataclass(frozen=True, slots=True)
class CheckpointQuantization:
    """How a checkpoint stores its FP8 weights: the scale tensor's name beside each
    ``weight`` and how one scale spreads over the weight."""

    method: str  # config.json's quant_method
    scale_suffix: str  # "weight_scale_inv" or "weight_scale"
    strategy: Strategy
    block_size: tuple[int, int] | None = None  # (rows, columns), for "block"


@dataclass(frozen=True, slots=True)
class Fp8Weight:
    """An e4m3 weight [out, in] and its float32 scale: [] per tensor, [out, 1] per
    output row, [ceil(out / rows), ceil(in / columns)] per block. What a GPU FP8 GEMM
    would keep on the device; the CPU calls ``dequantize`` once, at load."""

    values: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 weight: each e4m3 value times its scale."""
        scale = self.scale
        if self.block_size is not None:
            rows, columns = self.block_size
            num_rows, num_columns = self.values.shape
            scale = scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)
            scale = scale[:num_rows, :num_columns]  # the partial blocks at the edges
        return self.values.to(torch.float32) * scale

    def take_rows(self, pieces: Sequence[tuple[int, int]]) -> Fp8Weight:
        """Rows ``pieces`` ((start, length) each) stacked in that order, each with its
        scales: a weight whose checkpoint interleaves parts the model keeps apart
        (gpu/models/weights.py's ``Target.pieces``). Per block, every piece must start
        on a block and span whole ones unless it ends the weight (gpu/fp8_weights.py
        keeps no other layer in e4m3)."""
        values = torch.cat([self.values[start:start + length] for start, length in pieces])
        if self.block_size is None:
            if self.scale.dim() == 0:  # per tensor: every row's
                return Fp8Weight(values, self.scale)
            return Fp8Weight(values, torch.cat([self.scale[start:start + length]
                                                for start, length in pieces]))
        rows = self.block_size[0]
        assert all(start % rows == 0 for start, _ in pieces)
        scale = torch.cat([self.scale[start // rows:-(-(start + length) // rows)]
                           for start, length in pieces])
        return Fp8Weight(values, scale, self.block_size)


def quantize_rows(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` in e4m3 with one scale per output row (its largest magnitude / 448):
    ``--quantization fp8``. A row of zeros keeps a scale of one."""
    weight = weight.to(torch.float32)
    largest = weight.abs().amax(dim=1, keepdim=True)
    scale = torch.where(largest > 0, largest / E4M3_MAX, torch.ones_like(largest))
    values = (weight / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Weight(values, scale)


@dataclass(frozen=True, slots=True)
class Fp8Activation:
    """Rows already in e4m3 with one float32 scale per row ([rows, 1]): a norm's output
    quantized in the norm's kernel, for a per-channel FP8 GEMM (``dtype``: the rows'
    float dtype before, which the GEMM writes)."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return (self.values.to(torch.float32) * self.scales).to(self.dtype)


def quantize_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> Fp8Weight:
    """``weight`` in e4m3 with one scale per ``block_size`` block (partial at the edges),
    each its largest magnitude / 448 (1 for a block of zeros): a block-wise FP8
    checkpoint's form."""
    rows, columns = block_size
    num_rows, num_columns = weight.shape
    num_block_rows, num_block_columns = -(-num_rows // rows), -(-num_columns // columns)
    padded = torch.zeros(num_block_rows * rows, num_block_columns * columns,
                         dtype=torch.float32, device=weight.device)
    padded[:num_rows, :num_columns] = weight
    blocks = padded.view(num_block_rows, rows, num_block_columns, columns)
    largest = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(largest > 0, largest / E4M3_MAX, torch.ones_like(largest))
    expanded = scale.repeat_interleave(rows, 0).repeat_interleave(columns, 1)
    values = (padded / expanded).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Weight(values[:num_rows, :num_columns].contiguous(), scale, block_size)


def quantize_row_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, columns] in e4m3 with one scale per row and group of ``group_size``
    columns (the last group may be partial): (values, scales [rows, num_groups]). What
    the GPU's FP8 GEMMs do to their activations (gpu/kernels/fp8_gemm.py); with
    ``group_size`` = columns, ``quantize_rows``."""
    num_rows, num_columns = x.shape
    num_groups = -(-num_columns // group_size)
    padded = torch.zeros(num_rows, num_groups * group_size, dtype=torch.float32,
                         device=x.device)
    padded[:, :num_columns] = x
    quantized = quantize_rows(padded.view(num_rows * num_groups, group_size))
    values = quantized.values.view(num_rows, -1)[:, :num_columns]
    return values, quantized.scale.view(num_rows, num_groups)


# Device types whose models keep FP8 weights in e4m3 for the FP8 kernels (gpu/
# fp8_weights.py; tests add "cpu": gpu/layers/fp8_linear.py's Fp8Linear then computes in
# torch what the kernels compute).
FP8_DEVICE_TYPES = ("cuda",)


def keeps_fp8_weights(device: torch.device, is_parallel: bool) -> bool:
    """Whether a model on ``device`` may keep FP8 weights in e4m3 (else it dequantizes):
    a device type of FP8_DEVICE_TYPES, one rank (shards of block scales are not written
    yet)."""
    return device.type in FP8_DEVICE_TYPES and not is_parallel


def is_quantizable(parameter_name: str) -> bool:
    """Whether ``--quantization fp8`` quantizes the weights of this parameter."""
    return parameter_name.endswith(QUANTIZABLE_PARAMETER_SUFFIXES)


# -- the KV cache ------------------------------------------------------------------------

# --kv-cache-dtype's values: "auto" keeps the model's dtype (None here)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": E4M3, "fp8_e4m3": E4M3}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``--kv-cache-dtype name`` stores keys and values in."""
    if name not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"kv_cache_dtype {name!r} is not supported; supported: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


# The Triton attention kernels widen an e4m3 cache with the conversion instruction these
# GPUs have (gpu/kernels/triton_attention.py, _load_e4m3_tile): Ada and Hopper on.
FP8_KV_MIN_CAPABILITY = (8, 9)


def check_kv_cache_device(cache_dtype: torch.dtype, device: torch.device) -> None:
    """Refuse an e4m3 cache on a GPU older than FP8_KV_MIN_CAPABILITY, by name."""
    if cache_dtype != E4M3 or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_KV_MIN_CAPABILITY:
        raise ModelLoadError(
            f"kv_cache_dtype fp8 needs a GPU of compute capability "
            f"{'.'.join(map(str, FP8_KV_MIN_CAPABILITY))} or later (Ada, Hopper); "
            f"{device} is {'.'.join(map(str, capability))}: use kv_cache_dtype auto")


@dataclass(frozen=True, slots=True)
class KVScales:
    """One layer's KV cache scales: the cache holds ``key / k_scale``, ``value / v_scale``."""

    k_scale: float = 1.0
    v_scale: float = 1.0


def kv_scale_names(layer_index: int, weight_prefix: str = "model.") -> tuple[str, str, str]:
    """Checkpoint names of layer ``layer_index``'s KV cache scales: (k_scale, v_scale,
    kv_scale), the last one older checkpoints' single scale for both; ``weight_prefix``:
    where the checkpoint's layers are (ModelConfig.weight_prefix)."""
    prefix = f"{weight_prefix}layers.{layer_index}.self_attn."
    return prefix + "k_scale", prefix + "v_scale", prefix + "kv_scale"


def quantize_kv(tensor: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the cache stores it: divided by ``scale`` and saturated at e4m3's
    largest value (e4m3fn has no infinity: a value past it would turn NaN)."""
    if dtype != E4M3:
        return tensor.to(dtype)
    return (tensor.to(torch.float32) / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


# -- checkpoint tensors -----------------------------------------------------------------


def scale_name(quantization: CheckpointQuantization, weight_name: str) -> str:
    """The scale tensor beside checkpoint tensor ``weight_name`` (``...weight``)."""
    return weight_name.removesuffix("weight") + quantization.scale_suffix


def checkpoint_fp8_weight(quantization: CheckpointQuantization, name: str,
                          values: torch.Tensor, scale: torch.Tensor) -> Fp8Weight:
    """Checkpoint tensor ``name`` (e4m3) with its scale, the scale's shape checked
    against the format's."""
    if values.dim() != 2:
        raise ModelLoadError(f"tensor {name}: an FP8 weight must have 2 dimensions, "
                             f"found shape {list(values.shape)}")
    num_rows, num_columns = values.shape
    scale = scale.to(torch.float32)
    block_size = None
    if quantization.strategy == "tensor":
        expected: tuple[int, ...] = ()
        if scale.numel() == 1:
            scale = scale.reshape(())
    elif quantization.strategy == "channel":
        expected = (num_rows, 1)
        if scale.shape == (num_rows,):
            scale = scale.reshape(num_rows, 1)
    else:
        assert quantization.block_size is not None
        block_size = quantization.block_size
        expected = (-(-num_rows // block_size[0]), -(-num_columns // block_size[1]))
    if tuple(scale.shape) != expected:
        raise ModelLoadError(
            f"tensor {scale_name(quantization, name)}: shape {list(scale.shape)} does not "
            f"fit {quantization.strategy} scales of weight {list(values.shape)} "
            f"(expected {list(expected)})")
    return Fp8Weight(values, scale, block_size)


# -- config.json ------------------------------------------------------------------------


def parse_quantization(data: dict[str, Any], source: str) -> CheckpointQuantization | None:
    """config.json's ``quantization_config``: None when absent, the FP8 format when
    trio-llm reads it, else a ModelLoadError in one line naming the method."""
    config = data.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{source}: quantization_config must be an object")
    method = config.get("quant_method")
    if method is None and (config.get("load_in_4bit") or config.get("load_in_8bit")):
        method = "bitsandbytes"
    if method == "fp8":
        return _parse_fp8(config, source)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(config, source)
    raise _refused(source, f"quantization_config {method or 'of an unnamed method'!r} is "
                           f"not supported")


def _refused(source: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"{source}: {what}: trio-llm loads FP8 checkpoints (quant_method "
                          f"'fp8', or 'compressed-tensors' float-quantized, dynamic or no "
                          f"activation scales) and unquantized ones")


def _parse_fp8(config: dict[str, Any], source: str) -> CheckpointQuantization:
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refused(source, f"quantization_config 'fp8' with activation_scheme {scheme!r} "
                               f"(static activation scales) is not supported")
    if config.get("fmt", "e4m3") != "e4m3":
        raise _refused(source, f"quantization_config 'fp8' fmt {config['fmt']!r} is not "
                               f"supported (e4m3 only)")
    block = config.get("weight_block_size")
    if block is None:
        return CheckpointQuantization("fp8", "weight_scale", "tensor")
    return CheckpointQuantization("fp8", "weight_scale_inv", "block",
                                  _block_size(block, source, "weight_block_size"))


def _block_size(block: Any, source: str, field: str) -> tuple[int, int]:
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(size, int) and size > 0 for size in block)):
        raise ModelLoadError(f"{source}: quantization_config {field} must be two positive "
                             f"integers, found {block!r}")
    return block[0], block[1]


def _parse_compressed_tensors(config: dict[str, Any], source: str) -> CheckpointQuantization:
    method = "quantization_config 'compressed-tensors'"
    form = config.get("format")
    if form != "float-quantized":
        raise _refused(source, f"{method} format {form!r} is not supported")
    if config.get("kv_cache_scheme"):
        raise _refused(source, f"{method} kv_cache_scheme (an FP8 KV cache) is not supported")
    if config.get("sparsity_config"):
        raise _refused(source, f"{method} sparsity_config is not supported")
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{source}: {method} has no config_groups")
    schemes = {_group_scheme(name, group, source) for name, group in groups.items()}
    if len(schemes) > 1:
        raise _refused(source, f"{method} with config_groups of different weight strategies "
                               f"is not supported")
    strategy, block_size = schemes.pop()
    return CheckpointQuantization("compressed-tensors", "weight_scale", strategy, block_size)


def _group_scheme(name: str, group: Any, source: str
                  ) -> tuple[Strategy, tuple[int, int] | None]:
    what = f"quantization_config 'compressed-tensors' group {name!r}"
    if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
        raise ModelLoadError(f"{source}: {what} has no weights scheme")
    weights = group["weights"]
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise _refused(source, f"{what}: {weights.get('num_bits')}-bit {weights.get('type')} "
                               f"weights are not supported (8-bit float only)")
    if weights.get("dynamic") or weights.get("symmetric") is False:
        raise _refused(source, f"{what}: dynamic or asymmetric weight scales are not supported")
    if group.get("output_activations"):
        raise _refused(source, f"{what}: output activation quantization is not supported")
    activations = group.get("input_activations")
    if activations and not activations.get("dynamic"):
        raise _refused(source, f"{what}: static input activation scales (input_scale) are "
                               f"not supported")
    strategy = weights.get("strategy")
    if strategy == "block":
        return "block", _block_size(weights.get("block_structure"), source,
                                    f"group {name!r} block_structure")
    if strategy not in ("tensor", "channel"):
        raise _refused(source, f"{what}: weight strategy {strategy!r} is not supported")
    return strategy, None
