"""A fused Mixture-of-Experts layer in Triton (the CUDA path of the MoE families).

Each token is routed to ``top_k`` of ``E`` experts; expert ``e`` computes
``down_e(silu(gate_e(x)) * up_e(x))``, and a token's output is the sum of its
experts' outputs, each scaled by its routing weight. ``fused_moe`` computes it
without ever waiting on the host, so the whole layer can be captured in a CUDA
graph, along one of two paths.

The grouped path (``GroupedConfig``, any number of tokens):

1. ``align_by_expert`` (one kernel, two past ``ALIGN_CHUNK`` rows): the
   ``T * top_k`` (token, slot) rows are grouped by expert into segments padded
   to ``block_m`` rows, so that every ``block_m`` block of the sorted order
   belongs to one expert. The order has a fixed length (an upper bound, see
   ``max_sorted_rows``); the GEMMs skip the blocks past the real total, which
   they read from device memory;
2. the gate/up grouped GEMM: each program multiplies one block of rows by one
   ``block_n`` slice of its expert's gate and up projections (``tl.dot``, both
   accumulated in float32) and stores ``silu(gate) * up``: SwiGLU in the
   epilogue, the ``2 * I`` wide intermediate never reaches memory;
3. the down grouped GEMM over the activations, scaled by each row's routing
   weight in the epilogue;
4. the sum over a token's ``top_k`` rows, in slot order (with ``top_k == 1`` the
   down GEMM writes the output directly).

The row-wise path (``RowwiseConfig``, a few tokens: single-stream decode) needs
no alignment and no separate sum: a gate/up program takes one (token, slot) row
and a slice of its expert's columns, a down program one token and a slice of
the hidden columns, summing its slots in float32 registers. Both are GEMVs that
stream each weight once per row using it: two launches per layer.

Block sizes come from a table keyed by the token count, not from autotuning:
the kernels run inside CUDA graphs, and the interpreter that runs them in CI is
too slow to tune. A tuned table for the layer's shape, dtype and device
(``tuned_table``: a JSON file that benchmarks/moe_kernel_bench.py ``--tune``
writes, kept in gpu/kernels/moe_configs/ or in the folder that
``TRIO_LLM_MOE_CONFIGS`` names) is consulted first, as vLLM consults its tuned
configs; counts above its largest tuned one, and layers without one, use the
default ``CONFIGS`` (decode wants the row-wise path or short row blocks and
many column blocks, prefill long row blocks).

FP8 experts (an FP8 checkpoint's, or ``--quantization fp8``): ``w13`` and ``w2`` in
e4m3 with ``ExpertScales``, one float32 scale per (row block, column block) of each
expert's weight (128 x 128 in Qwen's FP8 releases; per output row: blocks of one row
and the whole depth).

- The row-wise path (a few tokens, bound by the weights' bytes), and the grouped one
  with short row blocks, widen each weight tile to the activations' dtype (exact:
  e4m3 values are bf16 values) and scale each step's float32 partial sum: FP8 weights,
  bf16 activations, half the bytes. With block scales the row-wise path scales each
  block's span of a step instead (as the FP8 GEMV does), so its steps stay as deep as
  the tuned ones (1,024 columns, 8 blocks) rather than one block deep.
- The grouped path with row blocks of ``FP8_INPUTS_MIN_BLOCK_M`` rows or more (bound
  by the tensor cores) runs the FP8 tensor cores, as the dense block GEMM does
  (gpu/kernels/fp8_gemm.py): each GEMM's input is quantized first (``quantize_groups``:
  one scale per row and group of the weight's scale columns; per token with one scale
  a row), and each step's product is scaled by both scales.

With one scale a row the grouped GEMMs chain their MMAs unscaled and scale each sum
once (a scale between steps makes every step wait for its MMA). Widened weights on
bf16 tensor cores at every block size were measured before: at 8,192 tokens 1.7 (per
row) and 3.6 (128 x 128 blocks) times bf16's time; on e4m3 wgmma, 0.76 and (with
``ExpertScales.fit``'s tiles) 1.7 (docs/performance.md, the eighth session).

The GPU path is not batch invariant (the path and tiles, hence the float32 sum
order, depend on the token count); the batch-invariant path is the CPU one.
``fused_moe_reference`` is the same math as a per-expert torch loop.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from trio_llm.gpu.kernels import tuned_tables
from trio_llm.gpu.kernels.fp8_gemm import quantize_groups
from trio_llm.gpu.kernels.pdl import pdl_launch, pdl_start
from trio_llm.gpu.kernels.triton_gemv import scale_block_spans

# The alignment's planning kernel is one program that reads the routing table in
# chunks of this many entries; up to this many rows it also places them itself,
# past it a second kernel places chunks of this many in parallel.
ALIGN_CHUNK = 1024


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """One GEMM's (or row-wise GEMV's) tile: output columns and reduction depth per
    step, warps, and how many reduction steps the compiler keeps in flight."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class GroupedConfig:
    """The grouped path: rows aligned by expert, each program a block of ``block_m`` rows
    of one expert. ``block_m`` is shared by the alignment and both GEMMs; ``group_m``
    row blocks share a column sweep (L2 reuse of the weights)."""

    block_m: int
    group_m: int
    gate_up: GemmConfig
    down: GemmConfig


@dataclass(frozen=True, slots=True)
class ExpertScales:
    """FP8 experts' scales: ``w13`` [E, ceil(2I / rows), ceil(H / columns)] and ``w2``
    [E, ceil(H / rows), ceil(I / columns)] for ``block_size`` (rows, columns); None:
    one scale per output row, ``w13`` [E, 2I, 1] and ``w2`` [E, H, 1]."""

    w13: torch.Tensor
    w2: torch.Tensor
    block_size: tuple[int, int] | None = None

    def groups(self, depth: int) -> tuple[int, int]:
        """(weight rows, reduction columns) one scale covers, for a weight ``depth`` deep."""
        return self.block_size if self.block_size is not None else (1, depth)

    def tile(self, tile: GemmConfig, depth: int) -> GemmConfig:
        """``tile`` with reduction steps no deeper than one block's columns (a power of two
        dividing them), so that each step has one scale per weight row (per-row scales
        span the whole depth: any step)."""
        columns = self.groups(depth)[1]
        if self.block_size is None or (tile.block_k <= columns and columns % tile.block_k == 0):
            return tile
        return dataclasses.replace(tile, block_k=min(tile.block_k, columns & -columns))

    def fit(self, config: MoeConfig, hidden_size: int, intermediate: int) -> MoeConfig:
        """``config`` as these experts run it: reduction steps within a scale's columns
        (``tile``), and with block scales on the grouped path, columns halved until the
        accumulators fit their registers twice over. Each step's product is scaled before
        it is added there, so it is live beside its accumulator: a tile sized for chained
        MMAs spills (the H100 ran 128 x 128 block-scaled experts 3.9x slower than per-row
        ones at 8,192 tokens, 4,457 against 1,149 us). The row-wise path scales each
        block's span of a step (``_block_scaled_products``): its steps stay as deep as
        tuned where the blocks' columns are a power of two (then one divides the other)."""
        if isinstance(config, RowwiseConfig) and self.block_size is not None and (
                self.block_size[1] & (self.block_size[1] - 1) == 0):
            return config
        gate_up = self.tile(config.gate_up, hidden_size)
        down = self.tile(config.down, intermediate)
        if self.block_size is not None and isinstance(config, GroupedConfig):
            gate_up = _registers_fit(gate_up, 2 * 2 * config.block_m)  # gate and up
            down = _registers_fit(down, 2 * config.block_m)
        return dataclasses.replace(config, gate_up=gate_up, down=down)


# float32 accumulator values a thread holds without spilling (of its 255 registers;
# benchmarks/moe_kernel_bench.py's tile filter assumes the same)
ACCUMULATOR_REGISTERS = 128


def _registers_fit(tile: GemmConfig, values_per_column: int) -> GemmConfig:
    """``tile`` with its columns halved (down to 16) until ``values_per_column`` float32
    values a column fit ACCUMULATOR_REGISTERS a thread of its warps."""
    budget = ACCUMULATOR_REGISTERS * 32 * tile.num_warps
    while tile.block_n > 16 and values_per_column * tile.block_n > budget:
        tile = dataclasses.replace(tile, block_n=tile.block_n // 2)
    return tile


@dataclass(frozen=True, slots=True)
class RowwiseConfig:
    """The row-wise path for a few tokens: no alignment, each gate/up program one
    (token, slot) row, each down program one token, summing its slots in registers
    (two launches in all). A weight slice is read once per row that uses it, so this
    pays only while few rows share an expert."""

    gate_up: GemmConfig
    down: GemmConfig


MoeConfig = GroupedConfig | RowwiseConfig

# (largest token count, configuration), in increasing order; the last entry covers
# every larger count. Guesses from the shapes of qwen3-30b-a3b (H=2048, E=128,
# top-8, I=768), for layers without a tuned table (``tuned_table``).
CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (2, RowwiseConfig(GemmConfig(16, 256, 4, 3), GemmConfig(8, 256, 4, 4))),
    (32, GroupedConfig(16, 1, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))),
    (128, GroupedConfig(16, 1, GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 4, 3))),
    (512, GroupedConfig(32, 8, GemmConfig(64, 128, 4, 3), GemmConfig(128, 128, 4, 3))),
    (1536, GroupedConfig(64, 8, GemmConfig(64, 64, 4, 3), GemmConfig(128, 64, 4, 3))),
    (1 << 62, GroupedConfig(128, 8, GemmConfig(128, 64, 8, 4), GemmConfig(256, 64, 8, 4))),
)


ConfigTable = tuple[tuple[int, MoeConfig], ...]


def config_for(num_tokens: int, tuned: ConfigTable = ()) -> MoeConfig:
    """The configuration for ``num_tokens`` tokens: the ``tuned`` entry of the smallest
    tuned count at or above it, else the default table's."""
    for table in (tuned, CONFIGS):
        for max_tokens, config in table:
            if num_tokens <= max_tokens:
                return config
    return CONFIGS[-1][1]


# A folder of tuned tables searched before gpu/kernels/moe_configs/ (a tuning run's
# output, tried before it is committed).
MOE_CONFIGS_ENV = "TRIO_LLM_MOE_CONFIGS"
BUILTIN_CONFIGS = Path(__file__).parent / "moe_configs"


def tuned_table_name(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                     device_name: str, block_size: tuple[int, int] | None = None) -> str:
    """The file name of a tuned table: one per layer shape (this rank's intermediate
    size), weight dtype, FP8 scale blocks (block-scaled experts scale every reduction
    step, so they want other tiles than per-row ones) and device model."""
    dtype_name = str(dtype).removeprefix("torch.")
    block = f",block={block_size[0]}x{block_size[1]}" if block_size is not None else ""
    return (f"experts={num_experts},hidden={hidden},intermediate={intermediate},"
            f"dtype={dtype_name}{block},device={device_name.replace(' ', '_')}.json")


def tuned_table(w13: torch.Tensor, scales: ExpertScales | None = None) -> ConfigTable:
    """The tuned table for the layer whose gate/up weights are ``w13`` [E, 2I, H] on its
    device (FP8 experts: with ``scales``), or () where none was tuned."""
    num_experts, two_intermediate, hidden = w13.shape
    name = tuned_table_name(num_experts, hidden, two_intermediate // 2, w13.dtype,
                            tuned_tables.device_name(w13.device),
                            scales.block_size if scales is not None else None)
    return tuned_tables.load_table(name, MOE_CONFIGS_ENV, BUILTIN_CONFIGS, read_table)


def read_table(path: Path) -> ConfigTable:
    """A tuned table from its JSON file: ``{"configs": [{"tokens": T, "config": ...}]}``,
    a config as ``config_to_json`` writes it; sorted by token count."""
    try:
        entries = json.loads(path.read_text())["configs"]
        table = tuple(sorted((int(entry["tokens"]), config_from_json(entry["config"]))
                             for entry in entries))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"tuned MoE table {path}: {error!r}") from error
    return table


def config_to_json(config: MoeConfig) -> dict:
    def tile(gemm: GemmConfig) -> list[int]:
        return [gemm.block_n, gemm.block_k, gemm.num_warps, gemm.num_stages]
    if isinstance(config, RowwiseConfig):
        return {"path": "rowwise", "gate_up": tile(config.gate_up), "down": tile(config.down)}
    return {"path": "grouped", "block_m": config.block_m, "group_m": config.group_m,
            "gate_up": tile(config.gate_up), "down": tile(config.down)}


def config_from_json(data: dict) -> MoeConfig:
    gate_up, down = GemmConfig(*data["gate_up"]), GemmConfig(*data["down"])
    if data["path"] == "rowwise":
        return RowwiseConfig(gate_up, down)
    if data["path"] == "grouped":
        return GroupedConfig(int(data["block_m"]), int(data["group_m"]), gate_up, down)
    raise ValueError(f"unknown path {data['path']!r} (rowwise or grouped)")


@dataclass(frozen=True, slots=True)
class ExpertPlan:
    """(token, slot) rows grouped by expert: ``sorted_rows[i]`` is a row index
    ``token * top_k + slot``, or ``num_rows`` for padding; ``block_experts[b]`` is
    the expert of rows ``[b * block_m, (b + 1) * block_m)``, or -1 past
    ``num_padded_rows`` (a one-element device tensor: the real length of the order)."""

    sorted_rows: torch.Tensor
    block_experts: torch.Tensor
    num_padded_rows: torch.Tensor
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.numel()


def max_sorted_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded length, fixed by the shapes alone (CUDA-graph safe):
    each expert that has rows pads at most ``block_m - 1`` of them, and at most
    ``min(num_rows, num_experts)`` experts have rows."""
    bound = num_rows + min(num_rows, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


# Counts that change with the batch are not specialised on (divisibility by 16, being
# 1): one compiled kernel serves every batch size, so no new batch compiles mid-capture.
@triton.jit(do_not_specialize=["num_rows", "num_blocks"])
def _plan_blocks_kernel(topk_ids_ptr, sorted_rows_ptr, block_experts_ptr, num_padded_ptr,
                        cursor_ptr, num_rows, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                        BLOCKS_CHUNK: tl.constexpr, CHUNK: tl.constexpr,
                        SCATTER: tl.constexpr):
    """One program: count each expert's rows, lay the padded segments end to end,
    name each block's expert, mark the segments padding (the scatter then
    overwrites the real rows) and leave each expert's first position in ``cursor``.
    With ``SCATTER`` (at most ``CHUNK`` rows) it places the rows itself, saving a launch."""
    experts = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):
        entries = start + tl.arange(0, CHUNK)
        # Entries past the end land in the last bin, which no expert uses.
        ids = tl.load(topk_ids_ptr + entries, mask=entries < num_rows, other=EXPERTS_PAD - 1)
        counts += tl.histogram(ids.to(tl.int32), EXPERTS_PAD)
    counts = tl.where(experts < num_experts, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    tl.store(cursor_ptr + experts, starts, mask=experts < num_experts)
    for first in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = first + tl.arange(0, BLOCKS_CHUNK)
        block_starts = blocks * BLOCK_M
        # A block belongs to the expert whose segment holds its first row: the number
        # of segments ending at or before that row (empty segments end where they start).
        owner = tl.sum((ends[None, :] <= block_starts[:, None]).to(tl.int32), 1)
        owner = tl.where(block_starts < total, owner, -1)
        tl.store(block_experts_ptr + blocks, owner, mask=blocks < num_blocks)
    for start in range(0, total, CHUNK):
        positions = start + tl.arange(0, CHUNK)
        tl.store(sorted_rows_ptr + positions, tl.full([CHUNK], 0, tl.int32) + num_rows,
                 mask=positions < total)
    if SCATTER:
        # The barrier orders the cursor and padding stores of every thread before the
        # atomics and row stores below.
        tl.debug_barrier()
        _scatter_chunk(topk_ids_ptr, sorted_rows_ptr, cursor_ptr, num_rows,
                       tl.arange(0, CHUNK))


@triton.jit
def _scatter_chunk(topk_ids_ptr, sorted_rows_ptr, cursor_ptr, num_rows, rows):
    """Each row takes the next free position of its expert's segment. The order within
    a segment depends on the atomics' order; no result does (a row's products never
    mix with another row's)."""
    mask = rows < num_rows
    ids = tl.load(topk_ids_ptr + rows, mask=mask, other=0).to(tl.int32)
    positions = tl.atomic_add(cursor_ptr + ids, 1, mask=mask, sem="relaxed")
    tl.store(sorted_rows_ptr + positions, rows, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _scatter_rows_kernel(topk_ids_ptr, sorted_rows_ptr, cursor_ptr, num_rows,
                         CHUNK: tl.constexpr):
    _scatter_chunk(topk_ids_ptr, sorted_rows_ptr, cursor_ptr, num_rows,
                   tl.program_id(0) * CHUNK + tl.arange(0, CHUNK))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertPlan:
    """Group the (token, slot) rows of ``topk_ids`` [T, top_k] by expert into segments
    padded to ``block_m`` rows; no host synchronisation."""
    num_rows = topk_ids.numel()
    device = topk_ids.device
    num_sorted = max_sorted_rows(num_rows, num_experts, block_m)
    num_blocks = num_sorted // block_m
    sorted_rows = torch.empty(num_sorted, dtype=torch.int32, device=device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded_rows = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    topk_ids = topk_ids.contiguous()
    # One spare bin past the experts for the masked entries; at least a warp of bins.
    experts_pad = max(32, triton.next_power_of_2(num_experts + 1))
    scatter_here = num_rows <= ALIGN_CHUNK
    _plan_blocks_kernel[(1,)](
        topk_ids, sorted_rows, block_experts, num_padded_rows, cursor, num_rows, num_experts,
        num_blocks, BLOCK_M=block_m, EXPERTS_PAD=experts_pad,
        BLOCKS_CHUNK=max(1, 8192 // experts_pad), CHUNK=ALIGN_CHUNK, SCATTER=scatter_here,
        num_warps=8)
    if not scatter_here:
        _scatter_rows_kernel[(triton.cdiv(num_rows, ALIGN_CHUNK),)](
            topk_ids, sorted_rows, cursor, num_rows, CHUNK=ALIGN_CHUNK, num_warps=4)
    return ExpertPlan(sorted_rows, block_experts, num_padded_rows, block_m)


@triton.jit
def _tile(program, num_m_blocks, num_n_blocks, group_m):
    """Programs walk ``group_m`` row blocks down one column block before the next column
    block, so that programs running together share their weight tiles in L2."""
    programs_per_group = group_m * num_n_blocks
    first_m = (program // programs_per_group) * group_m
    group_size = tl.minimum(num_m_blocks - first_m, group_m)
    within = program % programs_per_group
    return first_m + within % group_size, within // group_size


@triton.jit
def _block_rows(sorted_rows_ptr, block_experts_ptr, pid_m, BLOCK_M: tl.constexpr):
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    return rows, expert


@triton.jit
def _scale_rows(scale_ptr, expert, weight_rows, scale_expert_stride, scale_row_stride,
                GROUP_N: tl.constexpr):
    """Pointers to the FP8 scales of ``weight_rows`` of ``expert`` (their first column)."""
    return (scale_ptr + expert * scale_expert_stride
            + (weight_rows // GROUP_N).to(tl.int64) * scale_row_stride)


@triton.jit
def _step_scales(scale_ptr, expert, weight_rows, start, scale_expert_stride, scale_row_stride,
                 GROUP_N: tl.constexpr, GROUP_K: tl.constexpr):
    """The FP8 scales of ``weight_rows`` of ``expert`` for the reduction step at ``start``
    (one per row: a step never crosses a scale's columns, ExpertScales.tile)."""
    return tl.load(_scale_rows(scale_ptr, expert, weight_rows, scale_expert_stride,
                               scale_row_stride, GROUP_N) + start // GROUP_K)


@triton.jit
def _row_scales(scale_ptr, rows, scale_row_stride, row_mask, start, GROUP_K: tl.constexpr,
                FP8_INPUTS: tl.constexpr):
    """The e4m3 inputs' scales of ``rows`` for the reduction step at ``start``, as a
    [BLOCK_M, 1] column (0 for rows past the plan, whose values are zeros); 1 where the
    inputs are not e4m3."""
    scales = 1.0
    if FP8_INPUTS:
        scales = tl.load(scale_ptr + rows * scale_row_stride + start // GROUP_K,
                         mask=row_mask, other=0.0)[:, None]
    return scales


@triton.jit
def _load_rows(ptrs, row_mask, depth, start, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr):
    """A reduction step's [BLOCK_M, BLOCK_K] tile of the block's rows: rows past the plan,
    and columns past ``DEPTH`` where BLOCK_K does not divide it, read as zero."""
    if DEPTH % BLOCK_K == 0:
        tile = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        tile = tl.load(ptrs, mask=row_mask[:, None] & (depth < DEPTH - start)[None, :],
                       other=0.0)
    return tile


@triton.jit
def _load_weights(ptrs, depth, start, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr):
    """A reduction step's [BLOCK_K, BLOCK_N] weight tile, zero past ``DEPTH`` where
    BLOCK_K does not divide it."""
    if DEPTH % BLOCK_K == 0:
        tile = tl.load(ptrs)
    else:
        tile = tl.load(ptrs, mask=(depth < DEPTH - start)[:, None], other=0.0)
    return tile


@triton.jit(do_not_specialize=["num_rows", "num_m_blocks", "group_m"])
def _gate_up_kernel(hidden_ptr, w13_ptr, activation_ptr, sorted_rows_ptr, block_experts_ptr,
                    num_padded_ptr, num_rows, num_m_blocks, group_m, hidden_row_stride,
                    w13_expert_stride, w13_row_stride, scale_ptr, scale_expert_stride,
                    scale_row_stride, x_scale_ptr, x_scale_row_stride,
                    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    HAS_SCALES: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                    FP8_INPUTS: tl.constexpr):
    """activation[row, n] = silu(x . gate_e[n]) * (x . up_e[n]) for one block of rows
    (all of expert e) and BLOCK_N columns n; x is the row's token's hidden state (with
    FP8_INPUTS in e4m3, one scale per token and group of GROUP_K columns)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_m_blocks, tl.cdiv(INTERMEDIATE, BLOCK_N),
                         group_m)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, expert = _block_rows(sorted_rows_ptr, block_experts_ptr, pid_m, BLOCK_M)
    row_mask = rows < num_rows
    tokens = (rows // TOP_K).to(tl.int64)
    columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last column block re-reads the last weight row instead of masking its loads;
    # those columns are never stored.
    weight_rows = tl.minimum(columns, INTERMEDIATE - 1).to(tl.int64)
    depth = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + tokens[:, None] * hidden_row_stride + depth[None, :]
    gate_ptrs = (w13_ptr + expert * w13_expert_stride + weight_rows[None, :] * w13_row_stride
                 + depth[:, None])
    up_ptrs = gate_ptrs + INTERMEDIATE * w13_row_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, HIDDEN, BLOCK_K):
        x = _load_rows(x_ptrs, row_mask, depth, start, HIDDEN, BLOCK_K)
        gate_weights = _load_weights(gate_ptrs, depth, start, HIDDEN, BLOCK_K)
        up_weights = _load_weights(up_ptrs, depth, start, HIDDEN, BLOCK_K)
        if HAS_SCALES and GROUP_K < HIDDEN:  # block scales: each step scaled by its own
            x_scale = _row_scales(x_scale_ptr, tokens, x_scale_row_stride, row_mask, start,
                                  GROUP_K, FP8_INPUTS)
            gate += tl.dot(x, gate_weights.to(x.dtype)) * x_scale * _step_scales(
                scale_ptr, expert, weight_rows, start, scale_expert_stride, scale_row_stride,
                GROUP_N, GROUP_K)[None, :]
            up += tl.dot(x, up_weights.to(x.dtype)) * x_scale * _step_scales(
                scale_ptr, expert, weight_rows + INTERMEDIATE, start, scale_expert_stride,
                scale_row_stride, GROUP_N, GROUP_K)[None, :]
        else:  # bf16, or e4m3 with one scale a row (and a token): scaled after the sum
            gate = tl.dot(x, gate_weights.to(x.dtype), gate)
            up = tl.dot(x, up_weights.to(x.dtype), up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    if HAS_SCALES and GROUP_K >= HIDDEN:  # the MMAs above chained unscaled
        x_scale = _row_scales(x_scale_ptr, tokens, x_scale_row_stride, row_mask, 0, GROUP_K,
                              FP8_INPUTS)
        gate *= x_scale * _step_scales(scale_ptr, expert, weight_rows, 0, scale_expert_stride,
                                       scale_row_stride, GROUP_N, GROUP_K)[None, :]
        up *= x_scale * _step_scales(scale_ptr, expert, weight_rows + INTERMEDIATE, 0,
                                     scale_expert_stride, scale_row_stride, GROUP_N,
                                     GROUP_K)[None, :]
    activated = gate * tl.sigmoid(gate) * up
    out_ptrs = activation_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE + columns[None, :]
    tl.store(out_ptrs, activated.to(activation_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (columns < INTERMEDIATE)[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_m_blocks", "group_m"])
def _down_kernel(activation_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_rows_ptr,
                 block_experts_ptr, num_padded_ptr, num_rows, num_m_blocks, group_m,
                 w2_expert_stride, w2_row_stride, scale_ptr, scale_expert_stride,
                 scale_row_stride, a_scale_ptr, a_scale_row_stride,
                 HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALES: tl.constexpr,
                 GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, FP8_INPUTS: tl.constexpr):
    """out[row, n] = weight[row] * (activation[row] . down_e[n]) for one block of rows
    (all of expert e) and BLOCK_N hidden columns n (with FP8_INPUTS the activation in
    e4m3, one scale per row and group of GROUP_K columns)."""
    pid_m, pid_n = _tile(tl.program_id(0), num_m_blocks, tl.cdiv(HIDDEN, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, expert = _block_rows(sorted_rows_ptr, block_experts_ptr, pid_m, BLOCK_M)
    row_mask = rows < num_rows
    rows = rows.to(tl.int64)
    columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    weight_rows = tl.minimum(columns, HIDDEN - 1).to(tl.int64)
    depth = tl.arange(0, BLOCK_K)
    a_ptrs = activation_ptr + rows[:, None] * INTERMEDIATE + depth[None, :]
    w_ptrs = (w2_ptr + expert * w2_expert_stride + weight_rows[None, :] * w2_row_stride
              + depth[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, INTERMEDIATE, BLOCK_K):
        a = _load_rows(a_ptrs, row_mask, depth, start, INTERMEDIATE, BLOCK_K)
        w = _load_weights(w_ptrs, depth, start, INTERMEDIATE, BLOCK_K)
        if HAS_SCALES and GROUP_K < INTERMEDIATE:  # block scales: each step its own
            acc += tl.dot(a, w.to(a.dtype)) * _row_scales(
                a_scale_ptr, rows, a_scale_row_stride, row_mask, start, GROUP_K,
                FP8_INPUTS) * _step_scales(
                scale_ptr, expert, weight_rows, start, scale_expert_stride, scale_row_stride,
                GROUP_N, GROUP_K)[None, :]
        else:  # as in the gate/up kernel: one scale a row, applied after the sum
            acc = tl.dot(a, w.to(a.dtype), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALES and GROUP_K >= INTERMEDIATE:
        acc *= _row_scales(a_scale_ptr, rows, a_scale_row_stride, row_mask, 0, GROUP_K,
                           FP8_INPUTS) * _step_scales(scale_ptr, expert, weight_rows, 0,
                                                   scale_expert_stride, scale_row_stride,
                                                   GROUP_N, GROUP_K)[None, :]
    routing = tl.load(topk_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + rows[:, None] * HIDDEN + columns[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (columns < HIDDEN)[None, :])


@triton.jit
def _step_tiles(x_ptr, weight_ptrs, start, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr):
    """One reduction step of a GEMV, in float32: ``x[start:start + BLOCK_K]`` and the same
    columns of the weight rows that ``weight_ptrs`` point to (zeros past DEPTH)."""
    depth = start + tl.arange(0, BLOCK_K)
    if DEPTH % BLOCK_K == 0:
        x = tl.load(x_ptr + depth)
        # Each weight is read once: let it leave the caches first.
        w = tl.load(weight_ptrs[:, None] + depth[None, :], eviction_policy="evict_first")
    else:
        depth_mask = depth < DEPTH
        x = tl.load(x_ptr + depth, mask=depth_mask, other=0.0)
        w = tl.load(weight_ptrs[:, None] + depth[None, :], mask=depth_mask[None, :], other=0.0,
                    eviction_policy="evict_first")
    return x.to(tl.float32), w.to(tl.float32)


@triton.jit
def _row_products(x_ptr, weight_ptrs, start, DEPTH: tl.constexpr, BLOCK_K: tl.constexpr):
    """One reduction step of a GEMV: the products of ``_step_tiles``, summed per row."""
    x, w = _step_tiles(x_ptr, weight_ptrs, start, DEPTH, BLOCK_K)
    return tl.sum(w * x[None, :], 1)


@triton.jit
def _block_scaled_products(x_ptr, weight_ptrs, scale_rows, start, DEPTH: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr):
    """``_row_products`` for e4m3 weights with block scales (``scale_rows`` each row's
    scales): each span of the step's columns that one block covers is scaled by that
    block's scale before the sum, as the FP8 GEMV does (gpu/kernels/triton_gemv.py), so a
    step may cover several blocks (BLOCK_K and GROUP_K are powers of two: one divides the
    other, ExpertScales.fit)."""
    x, w = _step_tiles(x_ptr, weight_ptrs, start, DEPTH, BLOCK_K)
    every_row = tl.full([w.shape[0]], 1, tl.int1)  # (the rows are clamped in bounds)
    w = scale_block_spans(w, scale_rows, every_row, start, DEPTH, GROUP_K)
    return tl.sum(w * x[None, :], 1)


@triton.jit
def _rowwise_gate_up_kernel(hidden_ptr, w13_ptr, activation_ptr, topk_ids_ptr,
                            hidden_row_stride, w13_expert_stride, w13_row_stride, scale_ptr,
                            scale_expert_stride, scale_row_stride,
                            TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                            INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                            HAS_SCALES: tl.constexpr, GROUP_N: tl.constexpr,
                            GROUP_K: tl.constexpr, USE_PDL: tl.constexpr):
    """activation[row, n] = silu(x . gate_e[n]) * (x . up_e[n]) for one (token, slot)
    row, its expert e, and BLOCK_N columns n."""
    pdl_start(USE_PDL)  # after the routing (gpu/kernels/pdl.py)
    row = tl.program_id(0)
    expert = tl.load(topk_ids_ptr + row).to(tl.int64)
    x_ptr = hidden_ptr + (row // TOP_K).to(tl.int64) * hidden_row_stride
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weight_rows = tl.minimum(columns, INTERMEDIATE - 1).to(tl.int64)
    gate_ptrs = w13_ptr + expert * w13_expert_stride + weight_rows * w13_row_stride
    up_ptrs = gate_ptrs + INTERMEDIATE * w13_row_stride
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    gate_scales = _scale_rows(scale_ptr, expert, weight_rows, scale_expert_stride,
                              scale_row_stride, GROUP_N)
    up_scales = _scale_rows(scale_ptr, expert, weight_rows + INTERMEDIATE,
                            scale_expert_stride, scale_row_stride, GROUP_N)
    # num_stages on the loop: without a tl.dot the pipeliner prefetches only when asked.
    for start in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):
        if HAS_SCALES and GROUP_K < HIDDEN:  # block scales: each span of a step its own
            gate += _block_scaled_products(x_ptr, gate_ptrs, gate_scales, start, HIDDEN,
                                           BLOCK_K, GROUP_K)
            up += _block_scaled_products(x_ptr, up_ptrs, up_scales, start, HIDDEN, BLOCK_K,
                                         GROUP_K)
        else:  # bf16, or one scale a row: applied once, after the sum
            gate += _row_products(x_ptr, gate_ptrs, start, HIDDEN, BLOCK_K)
            up += _row_products(x_ptr, up_ptrs, start, HIDDEN, BLOCK_K)
    if HAS_SCALES and GROUP_K >= HIDDEN:
        gate *= tl.load(gate_scales)
        up *= tl.load(up_scales)
    activated = gate * tl.sigmoid(gate) * up
    tl.store(activation_ptr + row.to(tl.int64) * INTERMEDIATE + columns,
             activated.to(activation_ptr.dtype.element_ty), mask=columns < INTERMEDIATE)


@triton.jit
def _rowwise_down_kernel(activation_ptr, w2_ptr, out_ptr, topk_weights_ptr, topk_ids_ptr,
                         w2_expert_stride, w2_row_stride, scale_ptr, scale_expert_stride,
                         scale_row_stride,
                         TOP_K: tl.constexpr, HIDDEN: tl.constexpr,
                         INTERMEDIATE: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                         HAS_SCALES: tl.constexpr, GROUP_N: tl.constexpr,
                         GROUP_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[token, n] = sum over the token's slots of weight * (activation[row] . down_e[n]),
    summed in float32, for BLOCK_N hidden columns n."""
    pdl_start(USE_PDL)  # after the gate/up kernel
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    weight_rows = tl.minimum(columns, HIDDEN - 1).to(tl.int64)
    STEPS_PER_SLOT: tl.constexpr = (INTERMEDIATE + BLOCK_K - 1) // BLOCK_K
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    # One loop over every slot's reduction steps, so that the prefetch runs across
    # slots instead of draining at each.
    for step in tl.range(0, TOP_K * STEPS_PER_SLOT, num_stages=NUM_STAGES):
        row = token * TOP_K + step // STEPS_PER_SLOT
        expert = tl.load(topk_ids_ptr + row).to(tl.int64)
        down_ptrs = w2_ptr + expert * w2_expert_stride + weight_rows * w2_row_stride
        start = (step % STEPS_PER_SLOT) * BLOCK_K
        if HAS_SCALES and GROUP_K < INTERMEDIATE:  # block scales: each span its own
            products = _block_scaled_products(
                activation_ptr + row * INTERMEDIATE, down_ptrs,
                _scale_rows(scale_ptr, expert, weight_rows, scale_expert_stride,
                            scale_row_stride, GROUP_N), start, INTERMEDIATE, BLOCK_K, GROUP_K)
        else:
            products = _row_products(activation_ptr + row * INTERMEDIATE, down_ptrs, start,
                                     INTERMEDIATE, BLOCK_K)
        if HAS_SCALES and GROUP_K >= INTERMEDIATE:  # one scale a row
            products *= _step_scales(scale_ptr, expert, weight_rows, start, scale_expert_stride,
                                     scale_row_stride, GROUP_N, GROUP_K)
        total += products * tl.load(topk_weights_ptr + row).to(tl.float32)
    tl.store(out_ptr + token * HIDDEN + columns, total.to(out_ptr.dtype.element_ty),
             mask=columns < HIDDEN)


def _check_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  scales: ExpertScales | None = None) -> None:
    num_tokens, hidden_size = hidden.shape
    num_experts, two_intermediate, w13_hidden = w13.shape
    if w13_hidden != hidden_size or two_intermediate % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} is not [experts, 2 * intermediate, "
                         f"{hidden_size}] for hidden {tuple(hidden.shape)}")
    if tuple(w2.shape) != (num_experts, hidden_size, two_intermediate // 2):
        raise ValueError(f"w2 {tuple(w2.shape)} is not [{num_experts}, {hidden_size}, "
                         f"{two_intermediate // 2}] for w13 {tuple(w13.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{num_tokens}, top_k]")
    if scales is not None:
        _check_scales(w13, w2, scales)
    elif not hidden.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"hidden ({hidden.dtype}), w13 ({w13.dtype}) and w2 ({w2.dtype}) "
                         "must share one dtype")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if hidden.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("hidden, w13 and w2 must be contiguous in their last dimension")


def _check_scales(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales) -> None:
    for name, weight, scale in (("w13", w13, scales.w13), ("w2", w2, scales.w2)):
        rows, columns = scales.groups(weight.shape[2])
        expected = (weight.shape[0], -(-weight.shape[1] // rows), -(-weight.shape[2] // columns))
        if weight.dtype != torch.float8_e4m3fn or tuple(scale.shape) != expected:
            raise ValueError(f"FP8 {name} must be e4m3 with scales {list(expected)}; found "
                             f"{weight.dtype} with scales {list(scale.shape)}")
        if scale.dtype != torch.float32 or scale.stride(2) != 1:
            raise ValueError(f"{name}'s scales must be float32, contiguous in their last "
                             f"dimension")


def _scale_arguments(weight: torch.Tensor, scale: torch.Tensor | None,
                     scales: ExpertScales | None) -> tuple[object, ...]:
    """A kernel's scale pointer and strides (the weight itself, unread, without scales)."""
    if scale is None or scales is None:
        return weight, 0, 0
    return scale, scale.stride(0), scale.stride(1)


def _scale_flags(weight: torch.Tensor, scales: ExpertScales | None) -> dict[str, object]:
    """A kernel's HAS_SCALES, GROUP_N, GROUP_K for ``weight`` (its depth: weight.shape[2])."""
    if scales is None:
        return {"HAS_SCALES": False, "GROUP_N": 1, "GROUP_K": 1}
    rows, columns = scales.groups(weight.shape[2])
    return {"HAS_SCALES": True, "GROUP_N": rows, "GROUP_K": columns}


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              config: MoeConfig | None = None,
              scales: ExpertScales | None = None) -> torch.Tensor:
    """The MoE layer's output [T, H] for ``hidden`` [T, H], gate/up weights ``w13``
    [E, 2I, H] (rows [0, I) the gate, [I, 2I) the up projection), down weights ``w2``
    [E, H, I], and each token's experts ``topk_ids`` [T, k] with their routing weights
    ``topk_weights`` [T, k]. ``config`` overrides the tables (for tuning); ``scales``:
    the weights are e4m3 (FP8 experts)."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids, scales)
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    config = config or config_for(num_tokens, tuned_table(w13, scales))
    if scales is not None:
        config = scales.fit(config, hidden_size, intermediate)
    topk_weights, topk_ids = topk_weights.contiguous(), topk_ids.contiguous()
    num_rows = num_tokens * top_k
    activation = torch.empty((num_rows, intermediate), dtype=hidden.dtype, device=hidden.device)
    if isinstance(config, RowwiseConfig):
        launch_rowwise(hidden, w13, w2, topk_weights, topk_ids, activation, out, config, scales)
        return out
    plan = align_by_expert(topk_ids, num_experts, config.block_m)
    launch_gate_up(hidden, w13, activation, plan, top_k, config, scales)
    # One output row per (token, slot), summed over the slots below; with one slot a
    # row is a token, and the down GEMM writes the output itself.
    per_slot = out if top_k == 1 else torch.empty(
        (num_rows, hidden_size), dtype=hidden.dtype, device=hidden.device)
    launch_down(activation, w2, per_slot, topk_weights, plan, config, scales)
    if top_k > 1:
        torch.sum(per_slot.view(num_tokens, top_k, hidden_size), dim=1, out=out)
    return out


def launch_rowwise(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: torch.Tensor,
                   out: torch.Tensor, config: RowwiseConfig,
                   scales: ExpertScales | None = None) -> None:
    """The row-wise path's two launches: ``activation`` [T * top_k, I], then ``out``."""
    (num_rows, intermediate), (num_tokens, hidden_size) = activation.shape, out.shape
    top_k = topk_ids.shape[1]
    pdl = pdl_launch(hidden.device)
    tile = config.gate_up
    _rowwise_gate_up_kernel[(num_rows, triton.cdiv(intermediate, tile.block_n))](
        hidden, w13, activation, topk_ids, hidden.stride(0), w13.stride(0), w13.stride(1),
        *_scale_arguments(w13, scales.w13 if scales else None, scales)[:3],
        TOP_K=top_k, HIDDEN=hidden_size, INTERMEDIATE=intermediate, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages, **_scale_flags(w13, scales),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl)
    tile = config.down
    _rowwise_down_kernel[(num_tokens, triton.cdiv(hidden_size, tile.block_n))](
        activation, w2, out, topk_weights, topk_ids, w2.stride(0), w2.stride(1),
        *_scale_arguments(w2, scales.w2 if scales else None, scales)[:3],
        TOP_K=top_k, HIDDEN=hidden_size, INTERMEDIATE=intermediate, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages, **_scale_flags(w2, scales),
        num_warps=tile.num_warps, num_stages=tile.num_stages,
        **pdl)


def launch_gate_up(hidden: torch.Tensor, w13: torch.Tensor, activation: torch.Tensor,
                   plan: ExpertPlan, top_k: int, config: GroupedConfig,
                   scales: ExpertScales | None = None) -> None:
    """The first grouped GEMM with SwiGLU: ``activation`` [T * top_k, I] (rows by
    (token, slot), as ``plan`` was built for)."""
    num_rows, intermediate = activation.shape
    tile = config.gate_up
    grid = (plan.num_blocks * triton.cdiv(intermediate, tile.block_n),)
    fp8_inputs = quantizes_inputs(config, scales)
    hidden, hidden_scales = (_fp8_inputs(hidden, w13, scales)
                             if fp8_inputs and scales is not None else (hidden, hidden))
    _gate_up_kernel[grid](
        hidden, w13, activation, plan.sorted_rows, plan.block_experts, plan.num_padded_rows,
        num_rows, plan.num_blocks, config.group_m, hidden.stride(0), w13.stride(0),
        w13.stride(1), *_scale_arguments(w13, scales.w13 if scales else None, scales)[:3],
        hidden_scales, hidden_scales.stride(0), TOP_K=top_k, HIDDEN=hidden.shape[1],
        INTERMEDIATE=intermediate,
        BLOCK_M=plan.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        **_scale_flags(w13, scales), FP8_INPUTS=fp8_inputs, num_warps=tile.num_warps,
        num_stages=tile.num_stages)


def launch_down(activation: torch.Tensor, w2: torch.Tensor, per_slot: torch.Tensor,
                topk_weights: torch.Tensor, plan: ExpertPlan, config: GroupedConfig,
                scales: ExpertScales | None = None) -> None:
    """The second grouped GEMM with the routing weights: ``per_slot`` [T * top_k, H]."""
    num_rows, hidden_size = per_slot.shape
    tile = config.down
    grid = (plan.num_blocks * triton.cdiv(hidden_size, tile.block_n),)
    intermediate = activation.shape[1]
    fp8_inputs = quantizes_inputs(config, scales)
    activation, activation_scales = (_fp8_inputs(activation, w2, scales)
                                     if fp8_inputs and scales is not None
                                     else (activation, activation))
    _down_kernel[grid](
        activation, w2, per_slot, topk_weights, plan.sorted_rows, plan.block_experts,
        plan.num_padded_rows, num_rows, plan.num_blocks, config.group_m, w2.stride(0),
        w2.stride(1), *_scale_arguments(w2, scales.w2 if scales else None, scales)[:3],
        activation_scales, activation_scales.stride(0), HIDDEN=hidden_size,
        INTERMEDIATE=intermediate,
        BLOCK_M=plan.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        **_scale_flags(w2, scales), FP8_INPUTS=fp8_inputs, num_warps=tile.num_warps,
        num_stages=tile.num_stages)


# The grouped path runs the FP8 tensor cores (wgmma) from this many rows a block: with
# fewer, Triton lowers an e4m3 dot on sm_90 to mma.sync over operands converted in
# registers (seen in the compiled PTX), so quantizing the inputs would buy nothing.
FP8_INPUTS_MIN_BLOCK_M = 64
# The shallowest reduction step of an e4m3 dot that compiles for sm_90 (16 does not).
FP8_DOT_MIN_K = 32


def quantizes_inputs(config: GroupedConfig, scales: ExpertScales | None) -> bool:
    """Whether the grouped GEMMs under ``config`` (as the experts run it: ExpertScales.fit,
    which fused_moe applies) take their inputs in e4m3: FP8 experts, row blocks the FP8
    tensor cores take, and reduction steps an e4m3 dot takes. Else FP8 weights meet bf16
    inputs."""
    if scales is None or config.block_m < FP8_INPUTS_MIN_BLOCK_M:
        return False
    return min(config.gate_up.block_k, config.down.block_k) >= FP8_DOT_MIN_K


def input_groups(config: MoeConfig, scales: ExpertScales, hidden_size: int,
                 intermediate: int) -> tuple[int, int] | None:
    """The groups (hidden's, the activation's) in which the kernel under ``config`` takes
    each GEMM's input through e4m3 (``fused_moe_reference``'s ``fp8_groups``), or None
    where it takes the inputs as they are."""
    config = scales.fit(config, hidden_size, intermediate)
    if isinstance(config, RowwiseConfig) or not quantizes_inputs(config, scales):
        return None
    return scales.groups(hidden_size)[1], scales.groups(intermediate)[1]


def _fp8_inputs(x: torch.Tensor, weight: torch.Tensor, scales: ExpertScales
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A grouped GEMM's input [rows, depth] for ``weight`` in e4m3, one scale per row and
    group of the weight's scale columns (per token for per-row scales), and the scales."""
    return quantize_groups(x, scales.groups(weight.shape[2])[1])


def dequantized_experts(w13: torch.Tensor, w2: torch.Tensor, scales: ExpertScales,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 experts' weights in ``dtype``: each e4m3 value times its block's scale."""
    def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows, columns = scales.groups(weight.shape[2])
        spread = scale.repeat_interleave(rows, 1).repeat_interleave(columns, 2)
        return (weight.float() * spread[:, :weight.shape[1], :weight.shape[2]]).to(dtype)

    return dequantize(w13, scales.w13), dequantize(w2, scales.w2)


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                        fp8_groups: tuple[int, int] | None = None) -> torch.Tensor:
    """``fused_moe`` as a per-expert loop of float32 torch (it synchronises with the
    host). The activation is rounded to the input dtype, where the kernel hands it
    from one GEMM to the next; everything else stays in float32 until the output.
    ``fp8_groups`` (hidden's, the activation's): each GEMM's input goes through e4m3
    with one scale per row and group of that many columns first, as the grouped path
    of FP8 experts computes (the weights given here are the dequantized ones)."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    intermediate = w13.shape[1] // 2
    x = hidden.float()
    if fp8_groups is not None:
        x = _through_e4m3(x, fp8_groups[0])
    out = torch.zeros(x.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[expert].float().T
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        activated = (F.silu(gate) * up).to(hidden.dtype).float()
        if fp8_groups is not None:
            activated = _through_e4m3(activated, fp8_groups[1])
        expert_out = activated @ w2[expert].float().T
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)


def _through_e4m3(x: torch.Tensor, group: int) -> torch.Tensor:
    """float32 ``x`` [rows, columns] quantized to e4m3 per row and group of ``group``
    columns, and back: by the grouped path's own quantizer (whose bits are
    ``quantize_row_groups``'s on CUDA, tests/test_fp8_gemm.py; Triton's interpreter
    rounds some values to e4m3 without the carry into the exponent)."""
    values, scales = quantize_groups(x, group)
    return values.float() * scales.repeat_interleave(group, 1)[:, :x.shape[1]]
