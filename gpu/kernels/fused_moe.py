"""A fused Mixture-of-Experts layer in Triton (the CUDA path of the MoE families).

Each token is routed to ``top_k`` of ``E`` experts; expert ``e`` computes
``down_e(silu(gate_e(x)) * up_e(x))``, and a token's output is the sum of its
experts' outputs, each scaled by its routing weight. ``fused_moe`` does it in
five launches, none of which waits on the host, so the whole layer can be
captured in a CUDA graph:

1. ``align_by_expert`` (two small kernels): the ``T * top_k`` (token, slot)
   rows are grouped by expert into segments padded to ``block_m`` rows, so that
   every ``block_m`` block of the sorted order belongs to one expert. The
   sorted order has a fixed length (an upper bound, see ``max_sorted_rows``);
   the blocks past the real total are skipped by the GEMMs, which read that
   total from device memory.
2. the gate/up grouped GEMM: each program multiplies one block of rows by one
   ``block_n`` slice of its expert's gate and up projections, with both products
   accumulated in float32, and stores ``silu(gate) * up`` (SwiGLU in the
   epilogue: the ``2 * I`` wide intermediate never reaches memory);
3. the down grouped GEMM: the same over the activations, scaled by each row's
   routing weight in the epilogue;
4. the sum over a token's ``top_k`` rows, in slot order (with ``top_k == 1`` the
   down GEMM writes the output directly).

Block sizes come from a small table keyed by the token count (``CONFIGS``;
decode wants short blocks of rows and many column blocks, prefill long ones),
not from autotuning: the kernels run inside CUDA graphs, and the interpreter
that runs them in CI is too slow to tune. benchmarks/moe_kernel_bench.py
``--tune`` sweeps them on the device and prints the table.

The GPU path is not batch invariant (the configuration, hence the float32 sum
order, depends on the token count); the batch-invariant path is the CPU one.
``fused_moe_reference`` is the same math as a per-expert torch loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# The alignment's first kernel runs as one program over the routing table in
# chunks of this many entries; the second scatters chunks of this many in parallel.
ALIGN_CHUNK = 1024


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """One grouped GEMM's tile: output columns and reduction depth per step, warps,
    and how many reduction steps the compiler keeps in flight."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A launch of ``fused_moe``: rows per block (shared by the alignment and both
    GEMMs), how many row blocks share a column sweep (L2 reuse of the weights), and
    each GEMM's tile."""

    block_m: int
    group_m: int
    gate_up: GemmConfig
    down: GemmConfig


# (largest token count, configuration), in increasing order; the last entry covers
# every larger count. Guesses from the shapes of qwen3-30b-a3b (H=2048, E=128,
# top-8, I=768) until benchmarks/moe_kernel_bench.py --tune replaces them.
CONFIGS: tuple[tuple[int, MoeConfig], ...] = (
    (32, MoeConfig(16, 1, GemmConfig(32, 128, 4, 4), GemmConfig(64, 128, 4, 4))),
    (128, MoeConfig(16, 1, GemmConfig(64, 128, 4, 4), GemmConfig(128, 128, 4, 3))),
    (512, MoeConfig(32, 8, GemmConfig(64, 128, 4, 4), GemmConfig(128, 64, 4, 4))),
    (2048, MoeConfig(64, 8, GemmConfig(64, 64, 4, 4), GemmConfig(128, 64, 4, 4))),
    (1 << 62, MoeConfig(64, 8, GemmConfig(128, 64, 8, 4), GemmConfig(128, 64, 8, 4))),
)


def config_for(num_tokens: int) -> MoeConfig:
    """The table's configuration for ``num_tokens`` tokens."""
    for max_tokens, config in CONFIGS:
        if num_tokens <= max_tokens:
            return config
    return CONFIGS[-1][1]


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
                        BLOCKS_CHUNK: tl.constexpr, CHUNK: tl.constexpr):
    """One program: count each expert's rows, lay the padded segments end to end,
    name each block's expert, mark the segments padding (the scatter then
    overwrites the real rows) and leave each expert's first position in ``cursor``."""
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


@triton.jit(do_not_specialize=["num_rows"])
def _scatter_rows_kernel(topk_ids_ptr, sorted_rows_ptr, cursor_ptr, num_rows,
                         CHUNK: tl.constexpr):
    """Each row takes the next free position of its expert's segment. The order within
    a segment depends on the atomics' order; no result does (a row's products never
    mix with another row's)."""
    rows = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = rows < num_rows
    ids = tl.load(topk_ids_ptr + rows, mask=mask, other=0).to(tl.int32)
    positions = tl.atomic_add(cursor_ptr + ids, 1, mask=mask, sem="relaxed")
    tl.store(sorted_rows_ptr + positions, rows, mask=mask)


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
    _plan_blocks_kernel[(1,)](
        topk_ids, sorted_rows, block_experts, num_padded_rows, cursor, num_rows, num_experts,
        num_blocks, BLOCK_M=block_m, EXPERTS_PAD=experts_pad,
        BLOCKS_CHUNK=max(1, 8192 // experts_pad), CHUNK=ALIGN_CHUNK, num_warps=8)
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


@triton.jit(do_not_specialize=["num_rows", "num_m_blocks"])
def _gate_up_kernel(hidden_ptr, w13_ptr, activation_ptr, sorted_rows_ptr, block_experts_ptr,
                    num_padded_ptr, num_rows, num_m_blocks, group_m, hidden_row_stride,
                    w13_expert_stride, w13_row_stride,
                    TOP_K: tl.constexpr, HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """activation[row, n] = silu(x . gate_e[n]) * (x . up_e[n]) for one block of rows
    (all of expert e) and BLOCK_N columns n; x is the row's token's hidden state."""
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
        if HIDDEN % BLOCK_K == 0:
            x = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
            gate_weights = tl.load(gate_ptrs)
            up_weights = tl.load(up_ptrs)
        else:
            depth_mask = depth < HIDDEN - start
            x = tl.load(x_ptrs, mask=row_mask[:, None] & depth_mask[None, :], other=0.0)
            gate_weights = tl.load(gate_ptrs, mask=depth_mask[:, None], other=0.0)
            up_weights = tl.load(up_ptrs, mask=depth_mask[:, None], other=0.0)
        gate = tl.dot(x, gate_weights, gate)
        up = tl.dot(x, up_weights, up)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    activated = gate * tl.sigmoid(gate) * up
    out_ptrs = activation_ptr + rows.to(tl.int64)[:, None] * INTERMEDIATE + columns[None, :]
    tl.store(out_ptrs, activated.to(activation_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (columns < INTERMEDIATE)[None, :])


@triton.jit(do_not_specialize=["num_rows", "num_m_blocks"])
def _down_kernel(activation_ptr, w2_ptr, out_ptr, topk_weights_ptr, sorted_rows_ptr,
                 block_experts_ptr, num_padded_ptr, num_rows, num_m_blocks, group_m,
                 w2_expert_stride, w2_row_stride,
                 HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[row, n] = weight[row] * (activation[row] . down_e[n]) for one block of rows
    (all of expert e) and BLOCK_N hidden columns n."""
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
        if INTERMEDIATE % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            depth_mask = depth < INTERMEDIATE - start
            a = tl.load(a_ptrs, mask=row_mask[:, None] & depth_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=depth_mask[:, None], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    routing = tl.load(topk_weights_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * routing[:, None]
    out_ptrs = out_ptr + rows[:, None] * HIDDEN + columns[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (columns < HIDDEN)[None, :])


def _check_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
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
    if not hidden.dtype == w13.dtype == w2.dtype:
        raise ValueError(f"hidden ({hidden.dtype}), w13 ({w13.dtype}) and w2 ({w2.dtype}) "
                         "must share one dtype")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, not {topk_ids.dtype}")
    if hidden.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("hidden, w13 and w2 must be contiguous in their last dimension")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              config: MoeConfig | None = None) -> torch.Tensor:
    """The MoE layer's output [T, H] for ``hidden`` [T, H], gate/up weights ``w13``
    [E, 2I, H] (rows [0, I) the gate, [I, 2I) the up projection), down weights ``w2``
    [E, H, I], and each token's experts ``topk_ids`` [T, k] with their routing weights
    ``topk_weights`` [T, k]. ``config`` overrides the table (for tuning)."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden_size = hidden.shape
    num_experts, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    config = config or config_for(num_tokens)
    plan = align_by_expert(topk_ids, num_experts, config.block_m)
    num_rows = num_tokens * top_k
    activation = torch.empty((num_rows, intermediate), dtype=hidden.dtype, device=hidden.device)
    launch_gate_up(hidden, w13, activation, plan, top_k, config)
    # One output row per (token, slot), summed over the slots below; with one slot a
    # row is a token, and the down GEMM writes the output itself.
    per_slot = out if top_k == 1 else torch.empty(
        (num_rows, hidden_size), dtype=hidden.dtype, device=hidden.device)
    launch_down(activation, w2, per_slot, topk_weights.contiguous(), plan, config)
    if top_k > 1:
        torch.sum(per_slot.view(num_tokens, top_k, hidden_size), dim=1, out=out)
    return out


def launch_gate_up(hidden: torch.Tensor, w13: torch.Tensor, activation: torch.Tensor,
                   plan: ExpertPlan, top_k: int, config: MoeConfig) -> None:
    """The first grouped GEMM with SwiGLU: ``activation`` [T * top_k, I] (rows by
    (token, slot), as ``plan`` was built for)."""
    num_rows, intermediate = activation.shape
    tile = config.gate_up
    grid = (plan.num_blocks * triton.cdiv(intermediate, tile.block_n),)
    _gate_up_kernel[grid](
        hidden, w13, activation, plan.sorted_rows, plan.block_experts, plan.num_padded_rows,
        num_rows, plan.num_blocks, config.group_m, hidden.stride(0), w13.stride(0),
        w13.stride(1), TOP_K=top_k, HIDDEN=hidden.shape[1], INTERMEDIATE=intermediate,
        BLOCK_M=plan.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages)


def launch_down(activation: torch.Tensor, w2: torch.Tensor, per_slot: torch.Tensor,
                topk_weights: torch.Tensor, plan: ExpertPlan, config: MoeConfig) -> None:
    """The second grouped GEMM with the routing weights: ``per_slot`` [T * top_k, H]."""
    num_rows, hidden_size = per_slot.shape
    tile = config.down
    grid = (plan.num_blocks * triton.cdiv(hidden_size, tile.block_n),)
    _down_kernel[grid](
        activation, w2, per_slot, topk_weights, plan.sorted_rows, plan.block_experts,
        plan.num_padded_rows, num_rows, plan.num_blocks, config.group_m, w2.stride(0),
        w2.stride(1), HIDDEN=hidden_size, INTERMEDIATE=activation.shape[1],
        BLOCK_M=plan.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.num_warps, num_stages=tile.num_stages)


def fused_moe_reference(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``fused_moe`` as a per-expert loop of float32 torch (it synchronises with the
    host). The activation is rounded to the input dtype, where the kernel hands it
    from one GEMM to the next; everything else stays in float32 until the output."""
    _check_inputs(hidden, w13, w2, topk_weights, topk_ids)
    intermediate = w13.shape[1] // 2
    x = hidden.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(w13.shape[0]):
        tokens, slots = torch.where(topk_ids == expert)
        if tokens.numel() == 0:
            continue
        gate_up = x[tokens] @ w13[expert].float().T
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        activated = (F.silu(gate) * up).to(hidden.dtype).float()
        expert_out = activated @ w2[expert].float().T
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, slots, None].float())
    return out.to(hidden.dtype)
