"""FP8 GEMMs on CUDA: e4m3 activations times e4m3 weights, float32 sums, both scales.

Two weight layouts (gpu/quantization.py reads them from checkpoints or makes them):

- **per output channel** (``--quantization fp8``, compressed-tensors per channel or per
  tensor): the activations are quantized per token (one scale per row, its largest
  magnitude / 448) by ``quantize_groups`` and multiplied by ``torch._scaled_mm`` with
  row-wise scales (cuBLASLt's FP8 GEMM on Hopper): ``out[m, n] = scale_x[m] * scale_w[n]
  * sum_k x8[m, k] w8[n, k]``;
- **128 x 128 blocks** (Qwen's FP8 releases, ``weight_block_size``): the activations are
  quantized per token and per group of 128 columns, and cuBLASLt's block-scaled GEMM
  (torch's ``F.scaled_mm``, on Hopper: ``cublas_block_linear``) or ``block_fp8_matmul``
  (below, elsewhere) multiplies tile by tile, each K step's float32 partial product
  scaled by its row's group scale and its column block's weight scale before it is
  summed.

Every launch's grid depends on the shapes only and nothing reads a value back to the
host, so both run inside captured CUDA graphs. The scales are computed as the torch
reference computes them (``quantize_rows``: a correctly rounded division), so the
kernels store the reference's bits.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trio_llm.gpu.kernels import tuned_tables
from trio_llm.gpu.quantization import E4M3, E4M3_MAX, Fp8Activation

E4M3_LARGEST: tl.constexpr = tl.constexpr(E4M3_MAX)
QUANTIZE_BLOCK = 1024


@triton.jit
def _quantize_groups_kernel(x_ptr, out_ptr, scale_ptr, num_columns, x_row_stride,
                            out_row_stride, scale_row_stride, scale_group_stride,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, group of GROUP columns): the group's scale (its largest
    magnitude / 448; 1 for a group of zeros), then its values over the scale in e4m3."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    first = group * GROUP
    x_row = x_ptr + row * x_row_stride
    largest = tl.zeros([BLOCK], tl.float32)
    for offset in range(0, GROUP, BLOCK):
        columns = first + offset + tl.arange(0, BLOCK)
        mask = (columns < num_columns) & (offset + tl.arange(0, BLOCK) < GROUP)
        x = tl.load(x_row + columns, mask=mask, other=0.0).to(tl.float32)
        largest = tl.maximum(largest, tl.abs(x))
    amax = tl.max(largest, 0)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_LARGEST), 1.0)
    tl.store(scale_ptr + row * scale_row_stride + group * scale_group_stride, scale)
    for offset in range(0, GROUP, BLOCK):
        columns = first + offset + tl.arange(0, BLOCK)
        mask = (columns < num_columns) & (offset + tl.arange(0, BLOCK) < GROUP)
        x = tl.load(x_row + columns, mask=mask, other=0.0).to(tl.float32)
        quantized = tl.clamp(tl.math.div_rn(x, scale), -E4M3_LARGEST, E4M3_LARGEST)
        tl.store(out_ptr + row * out_row_stride + columns,
                 quantized.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_groups(x: torch.Tensor, group_size: int | None = None, *,
                    scales_by_group: bool = False, row_multiple: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, columns] in e4m3 with one float32 scale per row and group of
    ``group_size`` columns (None: the whole row, per-token scales): (values, scales
    [rows, ceil(columns / group_size)]). ``scales_by_group``: the scales stored group by
    group (strides (1, rows)), the layout cuBLASLt's block-scaled GEMM reads;
    ``row_multiple``: both padded with rows of no meaning up to a multiple of it (a
    GEMM's rows are independent: the caller drops the padding's products)."""
    num_rows, num_columns = x.shape
    group = group_size or num_columns
    num_groups = triton.cdiv(num_columns, group)
    padded_rows = triton.cdiv(num_rows, row_multiple) * row_multiple
    values = torch.empty((padded_rows, num_columns), dtype=E4M3, device=x.device)
    if scales_by_group:
        scales = torch.empty((num_groups, padded_rows), dtype=torch.float32,
                             device=x.device).t()
    else:
        scales = torch.empty((padded_rows, num_groups), dtype=torch.float32, device=x.device)
    if num_rows:
        assert x.stride(1) == 1
        _quantize_groups_kernel[(num_rows, num_groups)](
            x, values, scales, num_columns, x.stride(0), values.stride(0), scales.stride(0),
            scales.stride(1), GROUP=group,
            BLOCK=min(QUANTIZE_BLOCK, triton.next_power_of_2(group)), num_warps=4)
    return values, scales


def scaled_mm_rowwise(x: torch.Tensor | Fp8Activation, weight: torch.Tensor,
                      weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [rows, in] (bf16) times e4m3 ``weight`` [out, in] with ``weight_scale``
    [out, 1]: the activations quantized per token (unless a norm's kernel did it:
    an Fp8Activation), then an FP8 GEMM with row-wise scales (``rowwise_fp8_matmul``
    where ``rowwise_gemm_config`` gives a tile, from the weight's tuned table or the
    default rule, cuBLASLt's elsewhere) -> [rows, out] in ``x``'s dtype."""
    if isinstance(x, Fp8Activation):
        values, scales, dtype = x.values, x.scales, x.dtype
    else:
        dtype = x.dtype
        if x.shape[0] == 0:
            return torch.empty((0, weight.shape[0]), dtype=dtype, device=x.device)
        values, scales = quantize_groups(x)
    if values.shape[0] == 0:
        return torch.empty((0, weight.shape[0]), dtype=dtype, device=values.device)
    config = rowwise_gemm_config(values.shape[0], weight.shape[0], tuned_table(weight))
    if config is not None:
        return rowwise_fp8_matmul(values, scales, weight, weight_scale, bias, dtype, config)
    return torch._scaled_mm(values, weight.t(), scale_a=scales, scale_b=weight_scale.t(),
                            bias=bias, out_dtype=dtype)


# -- row-wise GEMM in Triton --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowwiseGemmConfig:
    """Tile and launch shape of ``rowwise_fp8_matmul``."""

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


# The default rule, for a weight shape or device without a tuned table (below): steps of
# up to ROWWISE_MAX_ROWS rows take the Triton GEMM at this tile, larger ones cuBLAS's;
# so do layers of fewer than ROWWISE_MIN_OUTPUTS outputs, narrower than any it was timed
# at (a 64-row step gives them fewer than 32 programs). At qwen3-8b's four projections
# on an H100 (a layer's GEMMs, us): 91.5 against cuBLAS's 102.8 at 128 rows, 93.9
# against 107.0 at 96, and with three stages 124.6 against 138.7 at 192; at 256 rows
# cuBLAS's 114.2 against 125.3. The nano-vllm workload (FP8 + FP8 KV) went 4.3% faster
# (benchmarks/fp8_rowwise_bench.py, docs/performance.md).
ROWWISE_CONFIG = RowwiseGemmConfig(block_m=64, block_n=128, block_k=256, num_warps=4,
                                   num_stages=4)
ROWWISE_MAX_ROWS = 192
ROWWISE_MIN_OUTPUTS = 4096


# A tuned table: (rows at most, the Triton GEMM's tile or None for cuBLAS's), sorted by
# rows; each entry serves the row counts above the previous entry's. qwen3-8b's tables
# took a layer's GEMMs from the default rule's 98.4 to 94.3 us at 128 rows, 118.1 to
# 108.8 at 256 and 187.9 to 162.8 at 320 on an H100, and the nano-vllm workload (FP8 +
# FP8 KV) 1.9% faster (docs/performance.md).
GemmTable = tuple[tuple[int, RowwiseGemmConfig | None], ...]


def rowwise_gemm_config(num_rows: int, num_out: int,
                        tuned: GemmTable = ()) -> RowwiseGemmConfig | None:
    """The Triton GEMM's tile for ``num_rows`` rows of a layer of ``num_out`` outputs, or
    None: cuBLAS's GEMM. The ``tuned`` table's entry where one serves the row count,
    else the rule above."""
    for max_rows, config in tuned:
        if num_rows <= max_rows:
            return config
    if num_rows <= ROWWISE_MAX_ROWS and num_out >= ROWWISE_MIN_OUTPUTS:
        return ROWWISE_CONFIG
    return None


# A folder of tuned tables searched before gpu/kernels/fp8_gemm_configs/ (a tuning run's
# output, tried before it is committed; benchmarks/fp8_rowwise_bench.py --tune).
FP8_GEMM_CONFIGS_ENV = "TRIO_LLM_FP8_GEMM_CONFIGS"
BUILTIN_CONFIGS = Path(__file__).parent / "fp8_gemm_configs"


def tuned_table_name(num_out: int, num_in: int, device_name: str) -> str:
    """The file name of a tuned table: one per weight shape (this rank's) and device
    model."""
    return f"out={num_out},in={num_in},device={device_name.replace(' ', '_')}.json"


def tuned_table(weight: torch.Tensor) -> GemmTable:
    """The tuned table of the e4m3 ``weight`` [out, in] on its device, or () where none
    was tuned."""
    num_out, num_in = weight.shape
    name = tuned_table_name(num_out, num_in, tuned_tables.device_name(weight.device))
    return tuned_tables.load_table(name, FP8_GEMM_CONFIGS_ENV, BUILTIN_CONFIGS, read_table)


def read_table(path: Path) -> GemmTable:
    """A tuned table from its JSON file: ``{"configs": [{"rows": R, "tile": T}]}``, T the
    tile's ``[block_m, block_n, block_k, num_warps, num_stages]`` or null (cuBLAS);
    sorted by row count."""
    try:
        entries = json.loads(path.read_text())["configs"]
        return tuple(sorted(((int(entry["rows"]), _tile_from_json(entry["tile"]))
                             for entry in entries), key=lambda entry: entry[0]))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"tuned FP8 GEMM table {path}: {error!r}") from error


def _tile_from_json(tile: list[int] | None) -> RowwiseGemmConfig | None:
    if tile is None:
        return None
    if len(tile) != 5:
        raise ValueError(f"a tile is [block_m, block_n, block_k, num_warps, num_stages], "
                         f"not {tile}")
    return RowwiseGemmConfig(*map(int, tile))


@triton.jit
def _output_tile(num_rows, num_out, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMM program's [BLOCK_M, BLOCK_N] output tile: (rows, columns, their masks). Row
    tiles go first, so the programs that share a weight tile run together (it is read
    from memory once)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, columns, rows < num_rows, columns < num_out


@triton.jit
def _load_k_step(x_rows, w_columns, k, num_in, row_mask, column_mask):
    """One K step's activations [rows, k] and weights [k, columns], zeros past the ends."""
    k_mask = k < num_in
    x = tl.load(x_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    w = tl.load(w_columns + k[:, None], mask=k_mask[:, None] & column_mask[None, :], other=0.0)
    return x, w


@triton.jit
def _store_output(out_ptr, acc, bias_ptr, rows, columns, row_mask, column_mask,
                  out_row_stride, HAS_BIAS: tl.constexpr):
    """The float32 tile ``acc`` plus the bias (``HAS_BIAS``) into the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + columns, mask=column_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + columns[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])


@triton.jit
def _rowwise_fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, num_rows, num_out, num_in,
    x_row_stride, x_scale_stride, w_row_stride, w_scale_stride, out_row_stride,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # The scales are per row and per output channel: applied once, after the sum.
    rows, columns, row_mask, column_mask = _output_tile(num_rows, num_out, BLOCK_M, BLOCK_N)
    steps = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_columns = w_ptr + columns.to(tl.int64)[None, :] * w_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, num_in, BLOCK_K):
        x, w = _load_k_step(x_rows, w_columns, start + steps, num_in, row_mask, column_mask)
        acc = tl.dot(x, w, acc)
    x_scale = tl.load(x_scale_ptr + rows * x_scale_stride, mask=row_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + columns * w_scale_stride, mask=column_mask, other=0.0)
    _store_output(out_ptr, acc * x_scale[:, None] * w_scale[None, :], bias_ptr, rows, columns,
                  row_mask, column_mask, out_row_stride, HAS_BIAS)


def rowwise_fp8_matmul(values: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype, config: RowwiseGemmConfig) -> torch.Tensor:
    """e4m3 activations ``values`` [rows, in] with per-row ``scales`` [rows, 1] times
    e4m3 ``weight`` [out, in] with per-channel ``weight_scale`` [out, 1] -> [rows, out]
    (what ``torch._scaled_mm`` computes with row-wise scales)."""
    num_rows, num_in = values.shape
    num_out = weight.shape[0]
    out = torch.empty((num_rows, num_out), dtype=out_dtype, device=values.device)
    if num_rows == 0:
        return out
    assert values.stride(1) == 1 and weight.stride(1) == 1
    grid = (triton.cdiv(num_rows, config.block_m), triton.cdiv(num_out, config.block_n))
    _rowwise_fp8_matmul_kernel[grid](
        values, scales, weight, weight_scale, bias if bias is not None else out, out,
        num_rows, num_out, num_in, values.stride(0), scales.stride(0), weight.stride(0),
        weight_scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# -- block-scaled GEMM ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockGemmConfig:
    """Tile and launch shape of ``block_fp8_matmul``: ``block_k`` is the scale group's
    width (one activation scale per row and K step)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3


# Few rows (decode) stream the weight: narrow column tiles give more programs to stream
# it with; many rows (prefill) are bound by the tensor cores: wide tiles.
SMALL_M_CONFIG = BlockGemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)
LARGE_M_CONFIG = BlockGemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
SMALL_M_MAX_ROWS = 32


def block_gemm_config(num_rows: int) -> BlockGemmConfig:
    return SMALL_M_CONFIG if num_rows <= SMALL_M_MAX_ROWS else LARGE_M_CONFIG


@triton.jit
def _block_fp8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, num_rows, num_out, num_in,
    x_row_stride, x_scale_row_stride, w_row_stride, w_scale_row_stride, out_row_stride,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Each K step is one scale group (GROUP_K columns), so one activation scale per row
    # and one weight scale per column block (GROUP_N rows of the weight) multiply that
    # step's float32 partial product.
    rows, columns, row_mask, column_mask = _output_tile(num_rows, num_out, BLOCK_M, BLOCK_N)
    steps = tl.arange(0, GROUP_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_columns = w_ptr + columns.to(tl.int64)[None, :] * w_row_stride
    x_scale_rows = x_scale_ptr + rows.to(tl.int64) * x_scale_row_stride
    w_scale_columns = w_scale_ptr + (columns // GROUP_N).to(tl.int64) * w_scale_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for group in range(0, tl.cdiv(num_in, GROUP_K)):
        x, w = _load_k_step(x_rows, w_columns, group * GROUP_K + steps, num_in, row_mask,
                            column_mask)
        x_scale = tl.load(x_scale_rows + group, mask=row_mask, other=0.0)
        w_scale = tl.load(w_scale_columns + group, mask=column_mask, other=0.0)
        # an e4m3 dot needs K >= 32 (fused_moe's FP8_DOT_MIN_K); tf32 holds e4m3 exactly
        if GROUP_K < 32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
    _store_output(out_ptr, acc, bias_ptr, rows, columns, row_mask, column_mask,
                  out_row_stride, HAS_BIAS)


def block_fp8_matmul(values: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor, block_size: tuple[int, int],
                     bias: torch.Tensor | None, out_dtype: torch.dtype,
                     config: BlockGemmConfig | None = None) -> torch.Tensor:
    """e4m3 activations ``values`` [rows, in] with ``scales`` [rows, ceil(in / block_k)]
    times e4m3 ``weight`` [out, in] with ``weight_scale`` [ceil(out / block_n),
    ceil(in / block_k)] (``block_size`` = (block_n, block_k)) -> [rows, out]."""
    num_rows, num_in = values.shape
    num_out = weight.shape[0]
    group_n, group_k = block_size
    out = torch.empty((num_rows, num_out), dtype=out_dtype, device=values.device)
    if num_rows == 0:
        return out
    assert values.stride(1) == 1 and weight.stride(1) == 1
    assert group_k >= 16 and triton.next_power_of_2(group_k) == group_k
    config = config or block_gemm_config(num_rows)
    grid = (triton.cdiv(num_rows, config.block_m), triton.cdiv(num_out, config.block_n))
    _block_fp8_matmul_kernel[grid](
        values, scales, weight, weight_scale, bias if bias is not None else out, out,
        num_rows, num_out, num_in, values.stride(0), scales.stride(0), weight.stride(0),
        weight_scale.stride(0), out.stride(0), GROUP_N=group_n, GROUP_K=group_k,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def block_scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        block_size: tuple[int, int], bias: torch.Tensor | None
                        ) -> torch.Tensor:
    """``x`` [rows, in] times a block-scaled e4m3 ``weight``: ``cublas_block_linear``
    where ``takes_cublas_blocks`` says so, else the activations quantized per token and
    per group of ``block_size[1]`` columns, then ``block_fp8_matmul``."""
    if takes_cublas_blocks(weight, block_size):
        return cublas_block_linear(x, weight, weight_scale, bias)
    values, scales = quantize_groups(x, block_size[1])
    return block_fp8_matmul(values, scales, weight, weight_scale, block_size, bias, x.dtype)


def cublas_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    """``block_scaled_linear`` through cuBLASLt (``F.scaled_mm``, 1 x 128 activation and
    128 x 128 weight scales): the same quantization, the scales stored group by group."""
    values, scales = quantize_groups(x, CUBLAS_BLOCK[1], scales_by_group=True,
                                     row_multiple=CUBLAS_ROW_MULTIPLE)
    out = F.scaled_mm(values, weight.t(), scales, F.ScalingType.BlockWise1x128,
                      weight_scale.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=x.dtype)[:x.shape[0]]
    return out if bias is None else out.add_(bias)


# cuBLASLt's block-scaled GEMM against the Triton block GEMM, the quantization in both,
# at qwen3-8b's four projections on an H100 (a layer's four GEMMs, from CUDA graph
# replays; benchmarks/fp8_gemm_bench.py, docs/performance.md): 102-105 against 113-121 us
# at 1 to 13 rows, 120-121 against 150 at 64, 245-246 against 394-406 at 512, 1,854-1,857
# against 3,007-3,024 at 4,096: faster at every row count. It serves Hopper only (cuBLAS
# has no 2-D block scales on Blackwell) and whole 128 x 128 blocks whose scales need no
# padding: torch's own tests pad the weight scales' rows to a multiple of 4 blocks, and
# run the activations in multiples of 128 rows; the activations here are padded to a
# multiple of CUBLAS_ROW_MULTIPLE rows, so each group's scales start 64-byte aligned.
CUBLAS_BLOCK = (128, 128)
CUBLAS_ROW_MULTIPLE = 16


def takes_cublas_blocks(weight: torch.Tensor, block_size: tuple[int, int]) -> bool:
    """Whether the block-scaled ``weight`` [out, in] multiplies through
    ``cublas_block_linear``: on a Hopper GPU with a torch that has ``F.scaled_mm``, with
    128 x 128 blocks that tile the weight, a multiple of 4 of them a row."""
    num_out, num_in = weight.shape
    return (tuple(block_size) == CUBLAS_BLOCK and num_out % CUBLAS_BLOCK[0] == 0
            and num_in % (4 * CUBLAS_BLOCK[1]) == 0 and weight.device.type == "cuda"
            and _has_cublas_blocks(weight.device.index))


@functools.cache
def _has_cublas_blocks(device_index: int | None) -> bool:
    return hasattr(F, "scaled_mm") and torch.cuda.get_device_capability(device_index)[0] == 9
