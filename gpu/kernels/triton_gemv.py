"""A memory-bound Triton GEMV for the few rows of a decode step.

At batch 1 a linear layer does two flops per weight it reads, so its time is
the time to stream the weights, and there cuBLAS reaches about 80% of the
H200's bandwidth. ``gemv(x, weight, bias)`` computes ``x W^T + b`` for at most
``MAX_GEMV_ROWS`` rows of ``x``:

- each program owns ``block_n`` outputs and walks the whole of K, loading each
  weight tile once and using it for every row: the weights cross the memory bus
  exactly once, and no two programs write the same output (no atomics, no
  split-K), so the result is the same run to run;
- a program is one warp, so a tile's products are summed within the warp (no
  barrier per step), and the activations load straight into the layout the
  weight tile's columns have;
- a row's products are summed in float32 in an order fixed by the launch
  configuration alone, which depends on (N, K), never on the number of rows, and
  each row has its own accumulator: row i of ``gemv(x[:m])`` is bitwise row i of
  ``gemv(x)`` (batch invariant);
- the configuration comes from a small rule on (N, K), not from autotuning: the
  kernels are captured into CUDA graphs, and the interpreter is too slow to tune.
  ``CANDIDATES`` holds the rules that benchmarks/gemv_bench.py compares.

FP8 weights take the same kernel (``SCALES``, a constexpr): the e4m3 values are
widened to float32 in registers, so a decode step reads one byte a weight, half of
bf16's, and multiplies the activations as they are (weight-only: no rounding of x
to e4m3). Per output channel the scale multiplies each output's float32 sum; per
128 x 128 block it multiplies the weight tile, each span of the tile by its block's
scale (a tile and a block are powers of two, so one divides the other), which is
``Fp8Weight.dequantize``'s product. An e4m3 weight takes its own rule
(``E4M3_CANDIDATE``: two outputs a program, K tiles of 2048, two warps), fastest in a
captured decode graph (benchmarks/gemv_sweep.py ``--quantization fp8``).
benchmarks/fp8_gemm_bench.py ``--decode`` times each layer's launch alone beside bf16
and the FP8 GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from trio_llm.gpu.kernels.pdl import (
    gdc_launch_dependents,
    gdc_wait,
    pdl_launch,
)
from trio_llm.gpu.quantization import E4M3

MAX_GEMV_ROWS = 8
# Rows up to which a linear layer multiplies with ``gemv`` (gpu/models/cuda_fused.py's
# GemvLinear, gpu/layers/fp8_linear.py's Fp8Linear). Measured on the H200 inside captured
# decode graphs (benchmarks/gemv_graph_ab.py, docs/performance.md): at 1 and 2 rows gemv
# beats cuBLAS (qwen3-8b 4.12 and 4.26 against 4.51 and 4.55 ms a step), at 4 rows
# cuBLAS wins for qwen3-8b (4.58 against 6.50 ms).
GEMV_ROWS = 2
# The rule ``gemv`` uses unless told otherwise; see CANDIDATES. Fastest at one row in
# captured decode graphs on the H200 (benchmarks/gemv_graph_ab.py, docs/performance.md).
DEFAULT_CANDIDATE = "one_output"
# e4m3 weights' rule (one byte a weight: a tile of bf16's shape has half the bytes in
# flight); fastest in qwen3-8b's FP8 decode graph on an H100 (benchmarks/gemv_sweep.py)
E4M3_CANDIDATE = "e4m3_two_outputs"
# One-warp programs wanted per launch: about eight per SM of an H200 (132 SMs),
# so that every SM streams and the last SM to finish is at most one program late.
MIN_PROGRAMS = 1024


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """One launch of ``_gemv_kernel``: outputs per program, the K tile, warps, and how
    many K tiles the compiler keeps in flight (1: plain loads, no software pipeline)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# How ``_gemv_kernel`` scales its weights (``SCALES``): not at all (a float weight), by
# one float32 per output row (FP8 per channel: ``scale`` [N, 1]), or by one per block of
# GROUP_N rows and GROUP_K columns (FP8 blocks: ``scale`` [ceil(N / GROUP_N),
# ceil(K / GROUP_K)]).
NO_SCALES: tl.constexpr = tl.constexpr(0)
ROW_SCALES: tl.constexpr = tl.constexpr(1)
BLOCK_SCALES: tl.constexpr = tl.constexpr(2)


@triton.jit
def _weight_tile(weight_rows, scale_rows, output_mask, start, K, columns, SCALES: tl.constexpr,
                 GROUP_K: tl.constexpr, EVEN: tl.constexpr):
    """The float32 weight tile of columns ``start + columns``; block-scaled weights come out
    dequantized (each e4m3 value times its block's scale, as Fp8Weight.dequantize does).
    EVEN: the tiles cover the weight exactly, so the loads need no mask (a masked load
    costs a select a weight: an eighth of the FP8 loop's instructions in sm_90 SASS)."""
    k = start + columns
    if weight_rows.dtype.element_ty.primitive_bitwidth == 8:
        # Loads of 8 e4m3 values a lane (a warp still reads 256 contiguous bytes): the
        # layout a bf16 row loads into, so the activations need no shuffles to meet the
        # weights (16 a lane cost a shuffle per weight and row, and more registers).
        k = tl.max_contiguous(k, 8)
    # Each weight is read once: let it leave the caches first, the activations last.
    if EVEN:
        weight = tl.load(weight_rows + k[None, :], eviction_policy="evict_first")
    else:
        weight = tl.load(weight_rows + k[None, :],
                         mask=output_mask[:, None] & (k < K)[None, :], other=0.0,
                         eviction_policy="evict_first")
    weight = weight.to(tl.float32)
    if SCALES == BLOCK_SCALES:
        weight = scale_block_spans(weight, scale_rows, output_mask, start, K, GROUP_K)
    return weight


@triton.jit
def scale_block_spans(weight, scale_rows, row_mask, start, depth, GROUP_K: tl.constexpr):
    """A float32 tile of block-scaled e4m3 weights [rows, BLOCK_K] from column ``start``,
    each span of its columns that one block covers times that block's scale
    (``scale_rows``: each row's scales; rows off ``row_mask`` and columns past ``depth``
    read none): ``Fp8Weight.dequantize``'s product. A tile and a block are powers of two,
    so one divides the other; the tile's shape is kept, only viewed by span. (The MoE
    kernel's row-wise path scales its steps with it too.)"""
    BLOCK_N: tl.constexpr = weight.shape[0]
    BLOCK_K: tl.constexpr = weight.shape[1]
    SPAN: tl.constexpr = BLOCK_K if BLOCK_K < GROUP_K else GROUP_K
    spans = start + tl.arange(0, BLOCK_K // SPAN) * SPAN
    scales = tl.load(scale_rows[:, None] + (spans // GROUP_K)[None, :],
                     mask=row_mask[:, None] & (spans < depth)[None, :], other=0.0)
    return tl.reshape(tl.reshape(weight, [BLOCK_N, BLOCK_K // SPAN, SPAN])
                      * scales[:, :, None], [BLOCK_N, BLOCK_K])


@triton.jit
def _row_products(weight, x_ptr, start, K, columns, EVEN: tl.constexpr):
    """One row's products with one weight tile, summed per output."""
    k = start + columns
    if EVEN:
        x = tl.load(x_ptr + k, eviction_policy="evict_last")
    else:
        x = tl.load(x_ptr + k, mask=k < K, other=0.0, eviction_policy="evict_last")
    return tl.sum(weight * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _add_row_products(sums, weight, x_ptr, x_row_stride, start, K, columns,
                      NUM_ROWS: tl.constexpr, EVEN: tl.constexpr):
    """``sums`` (one accumulator per row) plus each row's products with a weight tile."""
    for row in tl.static_range(NUM_ROWS):
        row_sum = sums[row] + _row_products(weight, x_ptr + row * x_row_stride, start, K,
                                            columns, EVEN)
        sums = sums[:row] + (row_sum,) + sums[row + 1:]
    return sums


@triton.jit
def _scaled_outputs(sums, scale_ptr, scale_row_stride, bias_ptr, outputs, output_mask,
                    out_dtype: tl.constexpr, NUM_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    SCALES: tl.constexpr):
    """Each row's sums times the rows' scales (per channel), plus the bias, rounded to
    the output's dtype, as a plain launch stores them."""
    if SCALES == ROW_SCALES:
        row_scales = tl.load(scale_ptr + outputs * scale_row_stride, mask=output_mask,
                             other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + outputs, mask=output_mask, other=0.0).to(tl.float32)
    for row in tl.static_range(NUM_ROWS):
        result = sums[row]
        if SCALES == ROW_SCALES:
            result *= row_scales
        if HAS_BIAS:
            result += bias
        sums = sums[:row] + (result.to(out_dtype),) + sums[row + 1:]
    return sums


@triton.jit
def _gemv_kernel(x_ptr, weight_ptr, scale_ptr, bias_ptr, out_ptr, N, K, x_row_stride,
                 weight_row_stride, scale_row_stride, NUM_ROWS: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SCALES: tl.constexpr, GROUP_N: tl.constexpr,
                 GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, SWIGLU: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """out = x W^T + b, [NUM_ROWS, N]; SWIGLU: W is [2 N, K], gate rows then up rows, and
    out = silu(gate) * up, each half rounded to the output's dtype first (the product a
    plain launch and ``silu_and_mul`` make: a program owns gate row j and up row j)."""
    outputs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    output_mask = outputs < N
    columns = tl.arange(0, BLOCK_K)
    weight_rows = weight_ptr + outputs.to(tl.int64)[:, None] * weight_row_stride
    up_rows = weight_rows + N.to(tl.int64) * weight_row_stride  # (read only if SWIGLU)
    # (the rows of block scales; unread unless SCALES is BLOCK_SCALES)
    scale_rows = scale_ptr + (outputs // GROUP_N).to(tl.int64) * scale_row_stride
    up_scale_rows = scale_ptr + ((N + outputs) // GROUP_N).to(tl.int64) * scale_row_stride
    # One accumulator per row, each updated by the same code whatever NUM_ROWS is.
    sums = (tl.zeros([BLOCK_N], dtype=tl.float32),) * NUM_ROWS
    up_sums = sums
    first_step = 0
    if USE_PDL:
        # Launched while the kernel before runs (gpu/kernels/pdl.py): the next kernel may
        # launch too, and the first weight tile, which no kernel writes, is fetched
        # before waiting; the sums are added in the same order as below.
        gdc_launch_dependents()
        weight = _weight_tile(weight_rows, scale_rows, output_mask, 0, K, columns, SCALES,
                              GROUP_K, EVEN)
        if SWIGLU:
            up = _weight_tile(up_rows, up_scale_rows, output_mask, 0, K, columns, SCALES,
                              GROUP_K, EVEN)
        gdc_wait()
        sums = _add_row_products(sums, weight, x_ptr, x_row_stride, 0, K, columns, NUM_ROWS,
                                 EVEN)
        if SWIGLU:
            up_sums = _add_row_products(up_sums, up, x_ptr, x_row_stride, 0, K, columns,
                                        NUM_ROWS, EVEN)
        first_step = BLOCK_K
    # num_stages on the loop itself: the pipeliner only prefetches loads that feed
    # no tl.dot when the loop asks for it.
    for start in tl.range(first_step, K, BLOCK_K, num_stages=NUM_STAGES):
        weight = _weight_tile(weight_rows, scale_rows, output_mask, start, K, columns, SCALES,
                              GROUP_K, EVEN)
        sums = _add_row_products(sums, weight, x_ptr, x_row_stride, start, K, columns,
                                 NUM_ROWS, EVEN)
        if SWIGLU:
            up = _weight_tile(up_rows, up_scale_rows, output_mask, start, K, columns, SCALES,
                              GROUP_K, EVEN)
            up_sums = _add_row_products(up_sums, up, x_ptr, x_row_stride, start, K, columns,
                                        NUM_ROWS, EVEN)
    out_dtype: tl.constexpr = out_ptr.dtype.element_ty
    results = _scaled_outputs(sums, scale_ptr, scale_row_stride, bias_ptr, outputs,
                              output_mask, out_dtype, NUM_ROWS, HAS_BIAS, SCALES)
    if SWIGLU:
        ups = _scaled_outputs(up_sums, scale_ptr + N * scale_row_stride, scale_row_stride,
                              bias_ptr + N, outputs, output_mask, out_dtype, NUM_ROWS,
                              HAS_BIAS, SCALES)
    for row in tl.static_range(NUM_ROWS):
        result = results[row]
        if SWIGLU:
            # silu_and_mul's rounding (gpu/kernels/triton_layers.py)
            gate = result.to(tl.float32)
            activated = (gate * tl.sigmoid(gate)).to(out_dtype)
            result = (activated.to(tl.float32) * ups[row].to(tl.float32)).to(out_dtype)
        tl.store(out_ptr + row * N + outputs, result, mask=output_mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         weight_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
         swiglu: bool = False, config: GemvConfig | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [num_rows <= MAX_GEMV_ROWS, K] and
    ``weight`` [N, K]: float32 sums, the result [num_rows, N] in ``x``'s dtype.
    ``swiglu``: ``silu_and_mul`` of that product instead, [num_rows, N / 2], in the same
    launch and bitwise the same (a SwiGLU block's gate/up projection: one kernel fewer
    a layer, and the [rows, N] product never stored).

    An e4m3 ``weight`` comes with its float32 ``weight_scale``: [N, 1] (one per output
    row, ``block_size`` None) or [ceil(N / block_n), ceil(K / block_k)] (``block_size``
    (block_n, block_k), block_k a power of two); the result is then
    ``F.linear(x, W, bias)`` for the dequantized weight W (gpu/quantization.py's
    ``Fp8Weight.dequantize``): the activations are used as they are, never rounded to
    e4m3. ``config`` overrides the default rule (benchmarks and tests).
    """
    num_rows, num_inputs = x.shape
    num_outputs = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert num_rows <= MAX_GEMV_ROWS and weight.shape[1] == num_inputs
    assert not swiglu or weight.shape[0] % 2 == 0
    assert weight.stride(1) == 1
    scales, group_n, group_k, scale_row_stride = _scale_layout(weight, weight_scale, block_size)
    assert scales != NO_SCALES or weight.dtype == x.dtype
    out = torch.empty((num_rows, num_outputs), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_outputs == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    # (a SwiGLU launch sums as the plain launch of the whole weight does: its rule)
    config = config or gemv_config(weight.shape[0], num_inputs, candidate=E4M3_CANDIDATE
                                   if weight.dtype == E4M3 else DEFAULT_CANDIDATE)
    pdl = pdl_launch(x.device)
    _gemv_kernel[(triton.cdiv(num_outputs, config.block_n),)](
        x, weight, weight if weight_scale is None else weight_scale,
        bias if bias is not None else weight, out, num_outputs, num_inputs, x.stride(0),
        weight.stride(0), scale_row_stride, NUM_ROWS=num_rows, HAS_BIAS=bias is not None,
        SCALES=scales, GROUP_N=group_n, GROUP_K=group_k, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, NUM_STAGES=config.num_stages,
        EVEN=num_inputs % config.block_k == 0 and num_outputs % config.block_n == 0,
        SWIGLU=swiglu, num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
    return out


def _scale_layout(weight: torch.Tensor, weight_scale: torch.Tensor | None,
                  block_size: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(``SCALES``, GROUP_N, GROUP_K, the scales' row stride) for a weight and its scales."""
    if weight_scale is None:
        assert block_size is None
        return NO_SCALES.value, 1, 1, 0
    num_outputs, num_inputs = weight.shape
    assert weight.dtype == E4M3 and weight_scale.dtype == torch.float32
    if block_size is None:
        assert weight_scale.shape == (num_outputs, 1)
        return ROW_SCALES.value, 1, 1, weight_scale.stride(0)
    group_n, group_k = block_size
    assert group_k & (group_k - 1) == 0  # a K tile's spans of one scale each
    assert weight_scale.shape == (triton.cdiv(num_outputs, group_n),
                                  triton.cdiv(num_inputs, group_k))
    assert weight_scale.stride(1) == 1
    return BLOCK_SCALES.value, group_n, group_k, weight_scale.stride(0)


def gemv_config(num_outputs: int, num_inputs: int,
                candidate: str = DEFAULT_CANDIDATE) -> GemvConfig:
    """The launch for an [N = num_outputs, K = num_inputs] weight under one of
    ``CANDIDATES``; it never depends on the number of rows (batch invariance). ``gemv``
    takes DEFAULT_CANDIDATE's rule for bf16 weights and E4M3_CANDIDATE's for e4m3."""
    return CANDIDATES[candidate](num_outputs, num_inputs)


def _block_n(num_outputs: int, widest: int) -> int:
    """The widest power of two up to ``widest`` that still makes MIN_PROGRAMS programs."""
    block_n = widest
    while block_n > 1 and triton.cdiv(num_outputs, block_n) < MIN_PROGRAMS:
        block_n //= 2
    return block_n


def _block_k(num_inputs: int, widest: int) -> int:
    return min(widest, max(16, triton.next_power_of_2(num_inputs)))


# A one-warp program covers 256 bf16 columns with one 16-byte load per lane, so a
# K tile of 512 or 1024 gives each lane 2 or 4 loads per output row, all issued
# before the first is used. Plain loads keep the activations in L1, where the
# next program on the SM finds them; the pipelined candidate copies them (like
# the weights) through L2 into shared memory for every program.

def _direct(num_outputs: int, num_inputs: int) -> GemvConfig:
    """Plain loads of an [up to 4, 1024] tile: up to 16 loads per lane in flight, and
    the other programs on the SM stream while this one sums."""
    return GemvConfig(_block_n(num_outputs, 4), _block_k(num_inputs, 1024), num_warps=1,
                      num_stages=1)


def _direct_512(num_outputs: int, num_inputs: int) -> GemvConfig:
    """As ``direct`` with half the tile: fewer registers, so more programs per SM."""
    return GemvConfig(_block_n(num_outputs, 4), _block_k(num_inputs, 512), num_warps=1,
                      num_stages=1)


def _pipelined(num_outputs: int, num_inputs: int) -> GemvConfig:
    """An [up to 4, 512] tile copied asynchronously into shared memory two steps ahead,
    so its loads stay in flight while the program sums."""
    return GemvConfig(_block_n(num_outputs, 4), _block_k(num_inputs, 512), num_warps=1,
                      num_stages=3)


def _one_output(num_outputs: int, num_inputs: int) -> GemvConfig:
    """One output per program, plain loads of a 1024-wide K tile: the most programs,
    so the most loads in flight across the SMs.

    With fewer outputs than MIN_PROGRAMS (an MoE router: 128 experts over 2048 inputs)
    every program runs at once and the launch lasts as long as one program's chain of
    K steps: a program takes all of K (up to 4096) in one step, a warp per 1024 inputs,
    so that its loads are issued together (one round trip to memory, not K / 1024).
    """
    if num_outputs < MIN_PROGRAMS:
        block_k = _block_k(num_inputs, 4096)
        return GemvConfig(1, block_k, num_warps=max(1, block_k // 1024), num_stages=1)
    return GemvConfig(1, _block_k(num_inputs, 1024), num_warps=1, num_stages=1)


def _e4m3_two_outputs(num_outputs: int, num_inputs: int) -> GemvConfig:
    """e4m3 weights' rule: two outputs a program over K tiles of 2048 with two warps,
    as many bytes a lane in flight as ``one_output``'s bf16 tile. In qwen3-8b's captured
    decode graph on an H100 (benchmarks/gemv_sweep.py --quantization fp8) 3.190 ms
    against 3.350 with ``one_output``'s tile, the best of 14. Layers of few outputs
    take ``one_output``'s."""
    if num_outputs < MIN_PROGRAMS:
        return _one_output(num_outputs, num_inputs)
    return GemvConfig(_block_n(num_outputs, 2), _block_k(num_inputs, 2048), num_warps=2,
                      num_stages=1)


CANDIDATES = {"direct": _direct, "direct_512": _direct_512, "pipelined": _pipelined,
              "one_output": _one_output, "e4m3_two_outputs": _e4m3_two_outputs}
