"""Linear layers that keep their weights in e4m3 on the device, and multiply in FP8.

On CUDA an FP8 model (an FP8 checkpoint, or ``--quantization fp8``) keeps each
projection's weight as the checkpoint's e4m3 values and their float32 scales: half the
bytes of bfloat16 for every decode step, the FP8 tensor cores for prefill. Two layouts
(``Fp8Layout``):

- **per output channel** (``scale`` [out, 1]; per-tensor checkpoint scales become one
  per row): activations quantized per token, ``torch._scaled_mm`` row-wise;
- **blocks** (``scale`` [ceil(out / block_n), ceil(in / block_k)]): activations quantized
  per token and per ``block_k`` columns, the block-scaled Triton GEMM.

Both are gpu/kernels/fp8_gemm.py's. A decode step of at most ``GEMV_ROWS`` rows (the
bound bf16 layers use, gpu/kernels/triton_gemv.py) is bound by the weights' bytes, not
by the tensor cores: it goes through the weight-only FP8 GEMV instead (``gemv`` with
the scales), which reads the e4m3 weights once and multiplies the activations as they
are. So the layer computes one of two functions, chosen by the number of rows alone
(static within a captured graph):

- at most GEMV_ROWS rows: ``x W^T + b`` for the dequantized weight W, x unrounded;
- more rows: ``q(x) W^T + b``, q rounding each row (or row and column group) to e4m3
  with its scale, as the GEMMs' activation quantization does.

Off CUDA (tests) the layer computes the same two functions in torch. The CPU engine
never builds these layers: it dequantizes at load (gpu/loader.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trio_llm.gpu.layers.linear import Linear
from trio_llm.gpu.quantization import E4M3, Fp8Activation, Fp8Weight, quantize_row_groups


@dataclass(frozen=True, slots=True)
class Fp8Layout:
    """How an FP8 model's projections keep their scales: ``block_size`` None per output
    channel, else (rows, columns) per block."""

    block_size: tuple[int, int] | None = None


class Fp8Linear(Linear):
    """A Linear whose ``weight`` is e4m3 and ``weight_scale`` float32 (see the module)."""

    weight_scale: nn.Parameter
    block_size: tuple[int, int] | None

    def takes_fp8_rows(self, num_rows: int) -> bool:
        """Whether this layer takes ``num_rows`` rows that a norm's kernel quantized (an
        Fp8Activation): a per-channel layer on CUDA given more than GEMV_ROWS rows (its
        input is quantized per row anyway; fewer rows go through the GEMV unrounded)."""
        from trio_llm.gpu.kernels import triton_gemv

        return (self.block_size is None and self.weight.device.type == "cuda"
                and num_rows > triton_gemv.GEMV_ROWS)

    def takes_gemv(self, x: torch.Tensor) -> bool:
        """Whether this layer multiplies ``x`` with the FP8 GEMV (CUDA decode rows)."""
        from trio_llm.gpu.kernels import triton_gemv

        return (x.device.type == "cuda" and x.dim() == 2
                and x.shape[0] <= triton_gemv.GEMV_ROWS)

    def gemv_rows(self, rows: torch.Tensor, *, swiglu: bool = False) -> torch.Tensor:
        """``rows`` through the FP8 GEMV (``swiglu``: with the SwiGLU of the product)."""
        from trio_llm.gpu.kernels.triton_gemv import gemv

        return gemv(rows, self.weight, self.bias, weight_scale=self.weight_scale,
                    block_size=self.block_size, swiglu=swiglu)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if isinstance(x, Fp8Activation):
            assert self.takes_fp8_rows(x.shape[0])
            from trio_llm.gpu.kernels.fp8_gemm import scaled_mm_rowwise

            return scaled_mm_rowwise(x, self.weight, self.weight_scale, self.bias)
        from trio_llm.gpu.kernels import triton_gemv

        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= triton_gemv.GEMV_ROWS:
            out = self._weight_only(rows)
        elif x.device.type != "cuda":
            out = self._reference(rows)
        elif self.block_size is None:
            from trio_llm.gpu.kernels.fp8_gemm import scaled_mm_rowwise

            out = scaled_mm_rowwise(rows, self.weight, self.weight_scale, self.bias)
        else:
            from trio_llm.gpu.kernels.fp8_gemm import block_scaled_linear

            out = block_scaled_linear(rows, self.weight, self.weight_scale, self.block_size,
                                      self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    def _weight_only(self, rows: torch.Tensor) -> torch.Tensor:
        """At most GEMV_ROWS rows: the unrounded input times the dequantized weight (the
        FP8 GEMV on CUDA, float32 torch elsewhere)."""
        if rows.device.type == "cuda":
            return self.gemv_rows(rows)
        return self._dequantized_linear(rows.to(torch.float32)).to(rows.dtype)

    def _reference(self, rows: torch.Tensor) -> torch.Tensor:
        """The GEMMs' function in torch (more than GEMV_ROWS rows): rounded input times
        the dequantized weight."""
        group = self.block_size[1] if self.block_size is not None else rows.shape[1]
        values, scales = quantize_row_groups(rows.to(torch.float32), group)
        columns = scales.repeat_interleave(group, 1)[:, :rows.shape[1]]
        return self._dequantized_linear(values.to(torch.float32) * columns).to(rows.dtype)

    def _dequantized_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``rows`` times the dequantized weight, plus the bias, in float32."""
        weight = Fp8Weight(self.weight, self.weight_scale, self.block_size).dequantize()
        return F.linear(rows, weight, None if self.bias is None else self.bias.to(torch.float32))


def takes_fp8_rows(layer: object, num_rows: int) -> bool:
    """Whether ``layer`` is an Fp8Linear that takes ``num_rows`` rows already in e4m3
    (``Fp8Linear.takes_fp8_rows``): the kernel before it may quantize them."""
    return isinstance(layer, Fp8Linear) and layer.takes_fp8_rows(num_rows)


def to_fp8_linear(linear: Linear, layout: Fp8Layout) -> Fp8Linear:
    """Make ``linear`` an Fp8Linear in place, its weight and scales empty (the loader
    fills them); returns it."""
    num_out, num_in = linear.weight.shape
    device = linear.weight.device
    if layout.block_size is None:
        scale_shape = (num_out, 1)
    else:
        rows, columns = layout.block_size
        scale_shape = (-(-num_out // rows), -(-num_in // columns))
    linear.__class__ = Fp8Linear
    fp8 = cast(Fp8Linear, linear)
    fp8.weight = nn.Parameter(torch.empty(num_out, num_in, dtype=E4M3, device=device),
                              requires_grad=False)
    fp8.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32,
                                               device=device), requires_grad=False)
    fp8.block_size = layout.block_size
    return fp8
