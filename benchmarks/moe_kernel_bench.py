"""Time gpu/kernels/fused_moe.py on the device; write $OUT/moe_kernel_bench.json.

    python benchmarks/moe_kernel_bench.py                  # qwen3-30b-a3b, eager launches
    python benchmarks/moe_kernel_bench.py --graph          # each timed call in a CUDA graph
    python benchmarks/moe_kernel_bench.py --model all      # and qwen3.5-35b-a3b
    python benchmarks/moe_kernel_bench.py --tune           # sweep block sizes per token count

At 1, 64, 256 and 8192 tokens (``--tokens``), routed by softmax top-k of random
logits, the kernel is first checked against ``fused_moe_reference`` (relative
error in bf16), then timed next to

- ``torch loop``: the per-expert loop a plain torch MoE runs (index the expert's
  tokens, two matmuls, SwiGLU, weighted index_add): it syncs with the host, so it
  is always timed eagerly, even with ``--graph``;
- ``dense``: the two matmuls of a dense MLP with the same active FLOPs
  (intermediate ``top_k * I``), the floor a grouped GEMM aims at.

The weights exist in ``--layers`` copies and consecutive calls cycle through
them, as a model's layers do, so that a decode step's experts (about 38 MB a
layer for qwen3-30b-a3b) come from memory, not from the 50 MB L2.
Time is the median over ``--repeats`` CUDA-event-timed runs of one call per
layer copy, after warm-up. TFLOP/s counts ``6 T k I H`` (three GEMMs per routed
row); GB/s counts the bytes of the experts actually routed to (each read
once; for ``dense`` its own weights, ``top_k`` experts' worth) plus the hidden
states in and out.

``--tune`` replays CUDA graphs of the row-wise path (up to ``ROWWISE_MAX_TOKENS``
tokens; its two launches are all of it) and of each grouped GEMM alone for
every candidate tile at each token count, BLOCK_M and group size (adding the
alignment and the top-k sum, the path's other launches), and writes the fastest
per count as a tuned table (gpu/kernels/fused_moe.py ``tuned_table``) to the
folder that ``TRIO_LLM_MOE_CONFIGS`` names, else $OUT/moe_configs/, merged with
the counts an earlier run tuned; ``fused_moe`` reads it from there at once (the
same device call can measure the tuned kernel), and from gpu/kernels/moe_configs/
once committed. ``--budget-s`` bounds a sweep: past it, untimed candidates are
skipped (the best so far is kept). Each new tile compiles once (about a second),
and Triton's cache keeps them for a later call.

    python benchmarks/moe_kernel_bench.py --tune --tokens 1 2 4 8 --budget-s 270
    python benchmarks/moe_kernel_bench.py --tune --tokens 64 256 1024 8192 --budget-s 500

``--fp8`` adds FP8 experts (per-row and 128 x 128 block scales) to the timed table;
with ``--tune`` it tunes FP8 experts (per-row scales, as ``--quantization fp8`` makes
them) instead, into the table fused_moe reads for e4m3 experts (``dtype=float8_e4m3fn``);
``--fp8-block 128 128`` tunes block-scaled ones (Qwen's FP8 releases) into a table of
their own (``dtype=float8_e4m3fn,block=128x128``): each reduction step's product is
scaled before it is added, so other tiles win.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch
import torch.nn.functional as F
import triton
from cuda_timing import event_times_ms

from trio_llm.gpu.kernels import fused_moe as moe
from trio_llm.gpu.quantization import E4M3

MoeConfigT = TypeVar("MoeConfigT", moe.RowwiseConfig, moe.GroupedConfig)


@dataclass(frozen=True, slots=True)
class MoeShape:
    hidden: int
    num_experts: int  # stacked: a stacked shared expert counts
    top_k: int  # picks a token: a stacked shared expert counts
    intermediate: int
    # the last expert is a stacked shared expert (gpu/layers/moe.py), in every token's picks
    shared: bool = False


SHAPES = {
    "qwen3-30b-a3b": MoeShape(hidden=2048, num_experts=128, top_k=8, intermediate=768),
    # 256 routed experts, top-8, and the shared expert of the same width stacked
    "qwen3.5-35b-a3b": MoeShape(hidden=2048, num_experts=257, top_k=9, intermediate=512,
                                shared=True),
}
TOKEN_COUNTS = (1, 64, 256, 8192)
TOLERANCE = 2e-2  # relative error of bf16 operands and a bf16 activation
# Where the layers live, and their dtype (a CPU smoke run under the interpreter changes both).
DEVICE, DTYPE = "cuda", torch.bfloat16


@dataclass(slots=True)
class Layer:
    """One MoE layer's inputs, its weights in ``copies`` (see the module docstring)."""

    hidden: torch.Tensor
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def make_layer(shape: MoeShape, num_tokens: int, copies: int) -> Layer:
    generator = torch.Generator(device=DEVICE).manual_seed(num_tokens)

    def random_bf16(*size: int, scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(*size, device=DEVICE, generator=generator) * scale
        return values.to(DTYPE)

    w13 = [random_bf16(shape.num_experts, 2 * shape.intermediate, shape.hidden,
                       scale=shape.hidden**-0.5) for _ in range(copies)]
    w2 = [random_bf16(shape.num_experts, shape.hidden, shape.intermediate,
                      scale=shape.intermediate**-0.5) for _ in range(copies)]
    hidden = random_bf16(num_tokens, shape.hidden)
    num_routed = shape.num_experts - shape.shared
    logits = torch.randn(num_tokens, num_routed, device=DEVICE, generator=generator)
    weights, ids = logits.softmax(-1).topk(shape.top_k - shape.shared, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if shape.shared:  # its sigmoid gate's weight: a half
        weights = torch.cat([weights, torch.full_like(weights[:, :1], 0.5)], dim=1)
        ids = torch.cat([ids, torch.full_like(ids[:, :1], num_routed)], dim=1)
    return Layer(hidden, w13, w2, weights, ids.to(torch.int32))


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.double() - expected.double()).norm() / expected.double().norm()).item()


def torch_loop(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """A plain torch MoE: per expert, its tokens through two matmuls, in bf16."""
    intermediate = w13.shape[1] // 2
    out = torch.zeros_like(hidden)
    for expert in topk_ids.unique().tolist():
        tokens, slots = torch.where(topk_ids == expert)
        gate, up = (hidden[tokens] @ w13[expert].T).split(intermediate, dim=-1)
        expert_out = (F.silu(gate) * up) @ w2[expert].T
        out.index_add_(0, tokens, expert_out * topk_weights[tokens, slots, None].to(out.dtype))
    return out


def time_per_call(calls: Sequence[Callable[[], object]], *, graph: bool, repeats: int) -> float:
    """Median microseconds of one call, from CUDA events around a pass over ``calls``."""
    run: Callable[[], object]
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for call in calls:  # warm-up compiles and settles the allocator first
                call()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            for call in calls:
                call()
        run = cuda_graph.replay
    else:
        def run() -> None:
            for call in calls:
                call()
    for _ in range(3):
        run()
    return statistics.median([ms * 1e3 / len(calls) for ms in event_times_ms(run, repeats)])


def flops(shape: MoeShape, num_tokens: int) -> float:
    return 6.0 * num_tokens * shape.top_k * shape.intermediate * shape.hidden


def bytes_moved(shape: MoeShape, layer: Layer, num_experts_read: int) -> float:
    """Each expert read once, the hidden states read and the output written."""
    expert_bytes = 3 * shape.intermediate * shape.hidden * 2
    return num_experts_read * expert_bytes + 2 * layer.hidden.numel() * 2


def bench_size(shape: MoeShape, num_tokens: int, args) -> dict:
    layer = make_layer(shape, num_tokens, args.layers)
    copies = range(args.layers)
    common = (layer.topk_weights, layer.topk_ids)
    out = moe.fused_moe(layer.hidden, layer.w13[0], layer.w2[0], *common)
    expected = moe.fused_moe_reference(layer.hidden, layer.w13[0], layer.w2[0], *common)
    config = moe.config_for(num_tokens, moe.tuned_table(layer.w13[0]))
    record: dict = {"tokens": num_tokens, "config": config_literal(config),
                    "relative_error": relative_error(out, expected)}
    if not record["relative_error"] < TOLERANCE:
        record["error"] = f"relative error {record['relative_error']:.3g} >= {TOLERANCE}"
        return record
    kernel = [lambda i=i: moe.fused_moe(layer.hidden, layer.w13[i], layer.w2[i], *common)
              for i in copies]
    record["fused_us"] = time_per_call(kernel, graph=args.graph, repeats=args.repeats)
    loop = [lambda i=i: torch_loop(layer.hidden, layer.w13[i], layer.w2[i], *common)
            for i in copies]
    record["torch_loop_us"] = time_per_call(loop, graph=False, repeats=max(3, args.repeats // 4))
    dense_gate_up = [w.view(-1, shape.hidden)[: 2 * shape.top_k * shape.intermediate]
                     for w in layer.w13]
    dense_down = [torch.randn(shape.hidden, shape.top_k * shape.intermediate, device=DEVICE,
                              dtype=DTYPE) for _ in copies]
    dense = [lambda i=i: dense_mlp(layer.hidden, dense_gate_up[i], dense_down[i]) for i in copies]
    record["dense_us"] = time_per_call(dense, graph=args.graph, repeats=args.repeats)
    # The MoE reads the experts it routes to; the dense MLP's weights are top_k experts' worth.
    moe_bytes = bytes_moved(shape, layer, layer.topk_ids.unique().numel())
    traffic = {"fused": moe_bytes, "torch_loop": moe_bytes,
               "dense": bytes_moved(shape, layer, shape.top_k)}
    if args.fp8:
        for name, block in (("fp8_rows", None), ("fp8_blocks", (128, 128))):
            record.update(bench_fp8(layer, block, name, args))
            traffic[name] = moe_bytes / 2  # e4m3 experts: half the bytes (scales aside)
    for name, num_bytes in traffic.items():
        seconds = record[f"{name}_us"] * 1e-6
        record[f"{name}_tflops"] = flops(shape, num_tokens) / seconds / 1e12
        record[f"{name}_gbps"] = num_bytes / seconds / 1e9
    return record


Experts = tuple[torch.Tensor, torch.Tensor, moe.ExpertScales | None]


def fp8_experts(layer: Layer, block: tuple[int, int] | None) -> list[Experts]:
    """Each copy of the layer's experts in e4m3 (one scale a row, or per ``block``)."""
    from trio_llm.gpu.quantization import quantize_blocks, quantize_rows

    def quantize(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [quantize_rows(w) if block is None else quantize_blocks(w, block)
                 for w in stacked]
        return torch.stack([p.values for p in parts]), torch.stack([p.scale for p in parts])

    experts: list[Experts] = []
    for w13, w2 in zip(layer.w13, layer.w2, strict=True):
        (w13_values, w13_scale), (w2_values, w2_scale) = quantize(w13), quantize(w2)
        experts.append((w13_values, w2_values, moe.ExpertScales(w13_scale, w2_scale, block)))
    return experts


def fp8_error(layer: Layer, experts: Experts, config: moe.MoeConfig) -> float:
    """The kernel's relative error with e4m3 ``experts`` under ``config`` against the
    reference over the dequantized experts (the inputs in e4m3 per row and scale group
    where the kernel quantizes them: fused_moe.input_groups)."""
    w13, w2, scales = experts
    assert scales is not None
    common = (layer.topk_weights, layer.topk_ids)
    out = moe.fused_moe(layer.hidden, w13, w2, *common, config=config, scales=scales)
    w13_plain, w2_plain = moe.dequantized_experts(w13, w2, scales, DTYPE)
    groups = moe.input_groups(config, scales, w13.shape[2], w2.shape[2])
    return relative_error(out, moe.fused_moe_reference(layer.hidden, w13_plain, w2_plain,
                                                       *common, fp8_groups=groups))


def bench_fp8(layer: Layer, block: tuple[int, int] | None, name: str, args) -> dict:
    """The kernel with the layer's experts in e4m3 (one scale a row, or per ``block``):
    its time, and its error against the reference over the dequantized experts."""
    experts = fp8_experts(layer, block)
    common = (layer.topk_weights, layer.topk_ids)
    calls = [lambda e=e: moe.fused_moe(layer.hidden, e[0], e[1], *common, scales=e[2])
             for e in experts]
    config = moe.config_for(layer.hidden.shape[0], moe.tuned_table(*experts[0][::2]))
    error = fp8_error(layer, experts[-1], config)
    if not error < TOLERANCE:
        raise ValueError(f"{name}: relative error {error:.3g} >= {TOLERANCE}")
    return {f"{name}_relative_error": error,
            f"{name}_us": time_per_call(calls, graph=args.graph, repeats=args.repeats)}


def dense_mlp(hidden, gate_up_weight, down_weight) -> torch.Tensor:
    """The dense GEMMs of the same active FLOPs (SwiGLU left out: it is not a GEMM)."""
    gate_up = hidden @ gate_up_weight.T
    return gate_up[:, : down_weight.shape[1]] @ down_weight.T


def print_table(model: str, records: list[dict]) -> None:
    print(f"\n{model}: per call, {'CUDA graph' if ARGS.graph else 'eager'} "
          "(torch loop always eager)")
    names = [name for name in ("fused", "torch_loop", "dense", "fp8_rows", "fp8_blocks")
             if any(f"{name}_us" in record for record in records)]
    header = f"{'tokens':>6} {'rel.err':>8}"
    for name in names:
        header += f" | {name + ' us':>16} {'TFLOP/s':>8} {'GB/s':>7}"
    print(header)
    for record in records:
        if "error" in record:
            print(f"{record['tokens']:>6} failed: {record['error']}")
            continue
        line = f"{record['tokens']:>6} {record['relative_error']:8.1e}"
        for name in names:
            line += (f" | {record[f'{name}_us']:16.1f} {record[f'{name}_tflops']:8.1f}"
                     f" {record[f'{name}_gbps']:7.0f}")
        print(line)


# --tune: the candidates. Decode (short row blocks) is bound by streaming the
# experts: narrow column blocks for many programs, deep reductions, many stages.
# Prefill is bound by the tensor cores: wide tiles, more warps. The row-wise path
# (GEMVs, no tensor cores) is tried up to ROWWISE_MAX_TOKENS.
DECODE_TILES = [moe.GemmConfig(n, k, 4, stages) for n, k, stages in
                itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 4, 5))]
PREFILL_TILES = [moe.GemmConfig(n, k, warps, stages) for n, k, warps, stages in
                 itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (3, 4))]
# Row-wise tiles: 16 to 64 weights a thread per step (enough loads in flight, few
# enough registers), plain loads or three steps in flight; one-warp programs down to
# a single output (the dense GEMV's fastest shape), wider ones from four outputs.
# (Block-scaled experts take them too: the row-wise kernels scale each block's span
# of a step, fused_moe._block_scaled_products.)
ROWWISE_TILES = [moe.GemmConfig(n, k, warps, stages) for n, k, warps, stages in
                 itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024), (1, 2, 4, 8),
                                   (1, 3))
                 if 16 <= n * k // (32 * warps) <= 64 and n * k <= 8192
                 and (warps == 1 or n >= 4)]
ROWWISE_MAX_TOKENS = 16
SHARED_MEMORY = 227 * 1024  # an H100/H200 SM's, per block


def block_m_candidates(num_tokens: int, shape: MoeShape) -> tuple[int, ...]:
    rows_per_expert = num_tokens * shape.top_k / shape.num_experts
    if rows_per_expert <= 4:
        return (16,)
    if rows_per_expert <= 32:
        return (16, 32, 64)
    return (64, 128)


def group_m_candidates(num_tokens: int, shape: MoeShape) -> tuple[int, ...]:
    """Grouping row blocks shares weight tiles in L2 only where an expert has several."""
    return (1,) if num_tokens * shape.top_k <= shape.num_experts else (1, 8)


# The grouped path where a block holds a row or two (fewer rows than experts): it
# competes with the row-wise path there, and a short list leaves the budget to both.
FEW_ROWS_TILES = [moe.GemmConfig(n, k, 4, stages) for n, k, stages in
                  itertools.product((32, 64), (128, 256), (3, 4))]


def tile_candidates(gemm: str, block_m: int, few_rows: bool = False,
                    fp8: bool = False, block_columns: int | None = None
                    ) -> list[moe.GemmConfig]:
    """The grouped tiles worth compiling: their pipelined operands (FP8 experts: one
    byte a weight, and an input too in row blocks that quantize it) fit in shared
    memory and their float32 accumulators (two for gate/up) in the registers of their
    warps. Block-scaled experts (``block_columns`` a scale block's columns) hold each
    step's product beside its accumulator, twice the registers (ExpertScales.fit), and
    take steps no deeper than a block."""
    num_weight_tiles = 2 if gemm == "gate_up" else 1
    weight_bytes = 1 if fp8 else 2
    input_bytes = 1 if fp8 and block_m >= moe.FP8_INPUTS_MIN_BLOCK_M else 2
    live_copies = 2 if block_columns is not None else 1
    fitting = []
    tiles = FEW_ROWS_TILES if few_rows else DECODE_TILES if block_m <= 32 else PREFILL_TILES
    for tile in tiles:
        operand_bytes = tile.block_k * (input_bytes * block_m
                                        + weight_bytes * num_weight_tiles * tile.block_n)
        accumulators = live_copies * num_weight_tiles * block_m * tile.block_n
        if (operand_bytes * tile.num_stages <= SHARED_MEMORY
                and accumulators <= moe.ACCUMULATOR_REGISTERS * tile.num_warps * 32
                and (block_columns is None or block_columns % tile.block_k == 0)):
            fitting.append(tile)
    return fitting


def fitting(config: MoeConfigT, experts: Experts) -> MoeConfigT:
    """``config`` as fused_moe runs it for ``experts`` (ExpertScales.fit)."""
    w13, w2, scales = experts
    if scales is None:
        return config
    return cast(MoeConfigT, scales.fit(config, w13.shape[2], w2.shape[2]))


class Budget:
    """The sweep's deadline (``--budget-s``): past it, candidates are no longer timed."""

    deadline = float("inf")
    skipped = 0

    @classmethod
    def spent(cls) -> bool:
        return time.monotonic() > cls.deadline


def time_launches(launches: list[Callable[[], object]], repeats: int) -> float:
    """Microseconds per launch, replayed from a CUDA graph (eager timing of a few
    microseconds of GPU work would measure Triton's launcher instead)."""
    if Budget.spent():
        Budget.skipped += 1
        return float("inf")
    try:
        return time_per_call(launches, graph=True, repeats=repeats)
    except Exception as error:  # a tile the compiler refuses (resources)
        print(f"    skipped: {type(error).__name__}: {str(error)[:120]}", flush=True)
        return float("inf")


@dataclass(slots=True)
class Tuning:
    """One token count's layer, buffers and alignments, shared by every candidate."""

    shape: MoeShape
    layer: Layer
    experts: list[Experts]  # the layer's copies as the kernel takes them (FP8: --fp8)
    activation: torch.Tensor
    per_slot: torch.Tensor
    out: torch.Tensor
    plans: dict[int, moe.ExpertPlan]
    repeats: int

    @property
    def block_columns(self) -> int | None:
        """A scale block's columns for block-scaled FP8 experts, else None."""
        scales = self.experts[0][2]
        return scales.block_size[1] if scales is not None and scales.block_size else None

    def fastest(self, launches: Callable[[moe.GemmConfig], list[Callable[[], object]]],
                tiles: list[moe.GemmConfig]) -> tuple[float, moe.GemmConfig]:
        timed = [(time_launches(launches(tile), self.repeats), tile) for tile in tiles]
        return min(timed, key=lambda result: result[0])

    def rowwise(self) -> tuple[float, moe.MoeConfig]:
        """The row-wise path (its two launches are all of it): the gate/up tile swept
        under a fixed down tile, then the down tile under the best gate/up one."""
        def both(config: moe.RowwiseConfig) -> list[Callable[[], object]]:
            return [functools.partial(self.launch_rowwise, experts, config)
                    for experts in self.experts]

        default = moe.CONFIGS[0][1]
        assert isinstance(default, moe.RowwiseConfig)
        # The default's own tiles first: a budget cut short still has them to beat.
        _, gate_up_tile = self.fastest(
            lambda tile: both(moe.RowwiseConfig(tile, default.down)),
            [default.gate_up, *ROWWISE_TILES])
        total, down_tile = self.fastest(
            lambda tile: both(moe.RowwiseConfig(gate_up_tile, tile)),
            [default.down, *ROWWISE_TILES])
        print(f"  row-wise: {total:.1f} us", flush=True)
        return total, moe.RowwiseConfig(gate_up_tile, down_tile)

    def launch_rowwise(self, experts: Experts, config: moe.RowwiseConfig) -> None:
        layer, (w13, w2, scales) = self.layer, experts
        moe.launch_rowwise(layer.hidden, w13, w2, layer.topk_weights, layer.topk_ids,
                           self.activation, self.out, fitting(config, experts), scales)

    def grouped(self, block_m: int, group_m: int) -> tuple[float, moe.MoeConfig]:
        """Each GEMM timed alone over the alignment for ``block_m``, plus the alignment
        and the top-k sum (the other launches of the grouped path)."""
        layer, plan = self.layer, self.plans[block_m]

        def gate_up(tile: moe.GemmConfig) -> list[Callable[[], object]]:
            config = moe.GroupedConfig(block_m, group_m, tile, tile)
            return [functools.partial(moe.launch_gate_up, layer.hidden, w13, self.activation,
                                      plan, self.shape.top_k, fitting(config, experts), scales)
                    for experts in self.experts for w13, _, scales in [experts]]

        def down(tile: moe.GemmConfig) -> list[Callable[[], object]]:
            config = moe.GroupedConfig(block_m, group_m, tile, tile)
            return [functools.partial(moe.launch_down, self.activation, w2, self.per_slot,
                                      layer.topk_weights, plan, fitting(config, experts),
                                      scales)
                    for experts in self.experts for _, w2, scales in [experts]]

        few_rows = self.layer.topk_ids.numel() <= self.shape.num_experts
        fp8 = self.experts[0][2] is not None
        gate_up_us, gate_up_tile = self.fastest(
            gate_up, tile_candidates("gate_up", block_m, few_rows, fp8, self.block_columns))
        down_us, down_tile = self.fastest(
            down, tile_candidates("down", block_m, few_rows, fp8, self.block_columns))
        overhead_us = time_launches([self.align_and_sum_for(block_m)], self.repeats)
        print(f"  block_m {block_m} group_m {group_m}: gate/up {gate_up_us:.1f} us, down "
              f"{down_us:.1f} us, alignment and sum {overhead_us:.1f} us", flush=True)
        total = gate_up_us + down_us + overhead_us
        return total, moe.GroupedConfig(block_m, group_m, gate_up_tile, down_tile)

    def align_and_sum_for(self, block_m: int) -> Callable[[], object]:
        num_tokens, top_k = self.layer.topk_ids.shape

        def align_and_sum() -> None:
            moe.align_by_expert(self.layer.topk_ids, self.shape.num_experts, block_m)
            if top_k > 1:
                torch.sum(self.per_slot.view(num_tokens, top_k, -1), dim=1, out=self.out)
        return align_and_sum


def tune_size(shape: MoeShape, num_tokens: int, args) -> dict:
    """The fastest configuration at ``num_tokens``: the row-wise path (for a few tokens)
    against the grouped one at each BLOCK_M and group size."""
    layer = make_layer(shape, num_tokens, args.layers)
    num_rows = num_tokens * shape.top_k
    experts: list[Experts] = (fp8_experts(layer, args.fp8_block) if args.fp8 else
                              [(w13, w2, None) for w13, w2 in zip(layer.w13, layer.w2,
                                                                  strict=True)])
    tuning = Tuning(
        shape, layer, experts,
        activation=torch.randn(num_rows, shape.intermediate, device=DEVICE).to(DTYPE),
        per_slot=torch.empty(num_rows, shape.hidden, device=DEVICE, dtype=DTYPE),
        out=torch.empty(num_tokens, shape.hidden, device=DEVICE, dtype=DTYPE),
        plans={block_m: moe.align_by_expert(layer.topk_ids, shape.num_experts, block_m)
               for block_m in block_m_candidates(num_tokens, shape)},
        repeats=args.repeats)
    # The row-wise path first where it may win: a budget cut short then has timed it.
    candidates = [tuning.rowwise()] if num_tokens <= ROWWISE_MAX_TOKENS else []
    candidates += [tuning.grouped(block_m, group_m) for block_m, group_m in
                   itertools.product(tuning.plans, group_m_candidates(num_tokens, shape))]
    for total, config in candidates:
        print(f"  tokens {num_tokens}: {total:.1f} us {config_literal(config)}", flush=True)
    total, config = min(candidates, key=lambda candidate: candidate[0])
    if args.fp8:
        error = fp8_error(layer, experts[0], config)
    else:
        inputs = (layer.hidden, layer.w13[0], layer.w2[0], layer.topk_weights, layer.topk_ids)
        error = relative_error(moe.fused_moe(*inputs, config=config),
                               moe.fused_moe_reference(*inputs))
    return {"tokens": num_tokens, "layer_us": total, "config": moe.config_to_json(config),
            "relative_error": error, "literal": config_literal(config)}


def config_literal(config: moe.MoeConfig) -> str:
    def tile(t: moe.GemmConfig) -> str:
        return f"GemmConfig({t.block_n}, {t.block_k}, {t.num_warps}, {t.num_stages})"
    if isinstance(config, moe.RowwiseConfig):
        return f"RowwiseConfig({tile(config.gate_up)}, {tile(config.down)})"
    return (f"GroupedConfig({config.block_m}, {config.group_m}, {tile(config.gate_up)}, "
            f"{tile(config.down)})")


def write_tuned(shape: MoeShape, tuned: list[dict], dtype: torch.dtype,
                block: tuple[int, int] | None = None) -> Path:
    """Merge the counts tuned now into the shape's tuned table (the counts tuned before,
    from the target folder or gpu/kernels/moe_configs/, stay unless re-tuned); return its
    path. A count covers the counts above the previous tuned one (fused_moe.config_for)."""
    name = moe.tuned_table_name(shape.num_experts, shape.hidden, shape.intermediate, dtype,
                                torch.cuda.get_device_name(), block)
    folder = Path(os.environ.get(moe.MOE_CONFIGS_ENV)
                  or Path(os.environ.get("OUT", ".")) / "moe_configs")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    entries: dict[int, dict] = {}
    for earlier in (moe.BUILTIN_CONFIGS / name, path):
        if earlier.is_file():
            entries |= {entry["tokens"]: entry
                        for entry in json.loads(earlier.read_text())["configs"]}
    for record in tuned:
        entries[record["tokens"]] = {key: record[key] for key in
                                     ("tokens", "layer_us", "relative_error", "config")}
    path.write_text(json.dumps({"environment": environment(), "shape": asdict(shape),
                                "configs": [entries[t] for t in sorted(entries)]}, indent=2))
    moe.read_table(path)  # it must read back
    return path


def print_tuned(tuned: list[dict]) -> None:
    for record in tuned:
        print(f"  {record['tokens']:>5} tokens: {record['layer_us']:.1f} us "
              f"{record['literal']} (rel.err {record['relative_error']:.1e})")


def environment() -> dict:
    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "triton": triton.__version__, "device": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=[*SHAPES, "all"], default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS))
    parser.add_argument("--graph", action="store_true", help="time inside a CUDA graph")
    parser.add_argument("--tune", action="store_true", help="sweep block sizes instead")
    parser.add_argument("--layers", type=int, default=4,
                        help="weight copies cycled through (keeps the experts out of L2)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--fp8", action="store_true",
                        help="also time FP8 experts (per-row and 128x128 block scales); "
                        "with --tune, tune FP8 experts (per-row scales) instead of bf16")
    parser.add_argument("--fp8-block", type=int, nargs=2, metavar=("ROWS", "COLUMNS"),
                        help="with --tune --fp8: experts with block scales of this size "
                        "(Qwen's FP8 releases: 128 128), a table of their own")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="--tune: stop timing new candidates after this many seconds")
    args = parser.parse_args(argv)
    if args.fp8_block and not (args.tune and args.fp8):
        parser.error("--fp8-block tunes block-scaled experts: it needs --tune --fp8")
    if args.fp8_block:  # (rows, columns), as ExpertScales keeps it
        args.fp8_block = tuple(args.fp8_block)
    return args


ARGS = parse_args([])


def main() -> None:
    global ARGS
    ARGS = args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_kernel_bench needs a CUDA device")
    out_path = Path(os.environ.get("OUT", ".")) / "moe_kernel_bench.json"
    results: dict = {"environment": environment(), "args": vars(args), "models": {}}
    print(json.dumps(results["environment"]))
    models = list(SHAPES) if args.model == "all" else [args.model]
    if args.budget_s is not None:
        Budget.deadline = time.monotonic() + args.budget_s
    failed = 0
    for model in models:
        records = []
        for num_tokens in args.tokens:
            started = time.monotonic()
            try:
                records.append((tune_size if args.tune else bench_size)(
                    SHAPES[model], num_tokens, args))
                print(f"{model} at {num_tokens} tokens: {time.monotonic() - started:.0f} s",
                      flush=True)
            except Exception as error:  # one size failing must not hide the others
                traceback.print_exc()
                records.append({"tokens": num_tokens,
                                "error": f"{type(error).__name__}: {error}"[:500]})
            failed += "error" in records[-1] or not records[-1].get("relative_error", 1) < TOLERANCE
            torch.cuda.empty_cache()
            results["models"][model] = records
            out_path.write_text(json.dumps(results, indent=2))  # what a timeout leaves
        if args.tune:
            # Only counts timed within the budget and checked against the reference.
            tuned = [r for r in records if "error" not in r and r["layer_us"] < float("inf")
                     and r["relative_error"] < TOLERANCE]
            print(f"\n{model}:")
            print_tuned(tuned)
            if tuned:
                path = write_tuned(SHAPES[model], tuned, E4M3 if args.fp8 else DTYPE,
                                   args.fp8_block)
                print(f"tuned table: {path} (commit it to "
                      f"gpu/kernels/moe_configs/); {Budget.skipped} candidates skipped "
                      "past the budget")
        else:
            print_table(model, records)
    print(f"\n{failed} sizes failed or exceeded relative error {TOLERANCE}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
