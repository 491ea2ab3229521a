"""The decode attention kernel alone over a bf16 and an FP8 cache, across decode tiles.

    python3 benchmarks/decode_tiles_bench.py

The cases, each with its own seeded contexts and the split count the engine would use
(``decode_num_splits``, by batch size):

- ``batch``: one decode step of qwen3-8b's attention (32 query heads, 8 KV heads of
  128) for 256 sequences of 100-2,048 cached tokens (graph_profile.py's contexts), the
  throughput workloads' shape;
- ``single-N``: one sequence of N cached tokens with qwen3-30b-a3b's heads (32 query
  heads, 4 KV heads), the single-stream decode's shape, where few programs run and a
  tile's latency, not the bandwidth, may set the time; the default tile is also timed
  at 1, 4 and 16 splits (one split needs no merge launch);
- ``batch-wide``: the batch at qwen3.5-27b's full attention (24 query heads, 4 KV
  heads of 256);
- ``single-384-wide``: the same at qwen3.5-27b's full attention (24 query heads, 4 KV
  heads of 256), whose decode graph took 1.1 ms longer at 384 tokens than at start-up
  (16 layers: about 68 us a layer if the attention were the cause).

The blocks are scattered over the cache. Each (block_n, num_warps, num_stages[,
max_registers]) is timed
by CUDA events around a graph of ten launches (median of 20 replays) and reported with
the cache bytes it reads per second: the decode kernel is meant to stream the cache,
so a tile whose rate falls well under the copy bandwidth is bound by something else.
Writes $OUT/decode_tiles.json.

    python3 benchmarks/decode_tiles_bench.py --baseline OLD/triton_attention.py

also times an earlier version of gpu/kernels/triton_attention.py (a copy of the file,
e.g. from ``git show REV:gpu/kernels/triton_attention.py``) at its default tile, in
turn with the current one's default tile, two rounds each, in the same process;
``--no-sweep`` leaves the other tiles out; ``--tiles 64,2,3 32,2,3`` times those tiles
in every case instead of the cases' own.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import random
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from cuda_timing import graph_launch_us  # benchmarks/, the script's folder

from trio_llm.gpu.kernels import triton_attention
from trio_llm.gpu.quantization import E4M3

BLOCK_SIZE = 16
# name: (context lengths, query heads, KV heads, head_dim, tiles); a tile is
# (positions, warps, stages[, registers a thread at most: ptxas's cap]).
# One stage (the 1s): no asynchronous copy into shared memory, so an e4m3 tile goes from
# its global load to the conversion in registers, one shared-memory read fewer. 14-47%
# slower than three stages over FP8 on an H100 (docs/performance.md).
# Capped registers: (128, 4, 3) takes 207-214 registers a thread, so an SM holds two of
# its programs (65,536 registers); at 168 it holds three, at 128 four (shared memory
# permitting), without spills in the loop (e4m3 at 128 spills there). Two-warp programs
# (the last two) reduce a tile's scores across fewer warps: not yet timed in a batch.
BATCH_TILES = [(128, 4, 3), (128, 4, 3, 168), (128, 4, 4, 168), (128, 4, 3, 128),
               (128, 8, 3), (128, 8, 3, 128), (64, 4, 3), (64, 4, 3, 128), (64, 4, 4, 128),
               (256, 4, 3), (128, 4, 1), (64, 4, 1), (64, 2, 3), (32, 2, 3)]
SINGLE_TILES = [(128, 4, 3), (64, 4, 3), (32, 4, 3), (32, 2, 2), (16, 2, 2), (64, 2, 3)]
WIDE_BATCH_TILES = [(64, 4, 3), (64, 4, 3, 168), (64, 4, 3, 128), (32, 4, 3),
                    (32, 4, 3, 128), (64, 8, 3, 128)]
_rng = random.Random(0)
BATCH_CONTEXTS = [_rng.randint(100, 2048) for _ in range(256)]
CASES = {
    "batch": (BATCH_CONTEXTS, 32, 8, 128, BATCH_TILES),
    "single-384": ([384], 32, 4, 128, SINGLE_TILES),
    "single-4096": ([4096], 32, 4, 128, SINGLE_TILES),
    "single-384-wide": ([384], 24, 4, 256, [(64, 4, 3), (32, 4, 3), (16, 4, 3)]),
    # the hybrid family's full attention batched (qwen3.5-27b's heads)
    "batch-wide": (BATCH_CONTEXTS, 24, 4, 256, WIDE_BATCH_TILES),
}


def scattered_block_tables(context_lens: list[int]) -> tuple[torch.Tensor, int]:
    """(block tables on the device, blocks in all): each sequence's blocks scattered over
    the cache, as a long-running server's are."""
    blocks = [-(-length // BLOCK_SIZE) for length in context_lens]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0))
    block_tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(blocks):
        block_tables[seq, :count] = order[taken:taken + count]
        taken += count
    return block_tables.cuda(), sum(blocks)


def paged_inputs(context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int):
    """(query, keys, values, block tables, context lens, query_start_loc), the blocks of
    each sequence scattered over the cache."""
    num_seqs = len(context_lens)
    block_tables, num_blocks = scattered_block_tables(context_lens)
    query = torch.randn(num_seqs, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device="cuda",
                       dtype=torch.bfloat16)
    return (query, keys, torch.randn_like(keys), block_tables,
            torch.tensor(context_lens, dtype=torch.int32, device="cuda"),
            torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"))


def parse_tile(text: str) -> tuple[int, ...]:
    """``--tiles``' "64,2,3" as (64, 2, 3)."""
    return tuple(int(part) for part in text.split(","))


def load_baseline(path: str):
    """An earlier triton_attention.py as a module of its own (its own kernels)."""
    spec = importlib.util.spec_from_file_location("baseline_triton_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="an earlier gpu/kernels/triton_attention.py")
    parser.add_argument("--no-sweep", action="store_true",
                        help="the default tile only (each other tile is a compile)")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--tiles", nargs="+", type=parse_tile,
                        help="these tiles in every case instead of the case's own, each "
                             "as positions,warps,stages[,registers]")
    args = parser.parse_args()
    baseline = load_baseline(args.baseline) if args.baseline else None
    torch.manual_seed(0)
    results: dict[str, object] = {"device": torch.cuda.get_device_name()}

    def record(key: str, launch: Callable[[], object], bytes_read: int) -> None:
        try:
            us = graph_launch_us(launch)
            results[key] = {"us": us, "gb_per_s": bytes_read / us / 1e3}
        except Exception as error:  # a tile past the shared memory
            results[key] = repr(error)[:120]
        print(key, results[key], flush=True)

    for case in args.cases:
        context_lens, num_heads, num_kv_heads, head_dim, tiles = CASES[case]
        query, keys, values, block_tables, lens, query_start_loc = paged_inputs(
            context_lens, num_heads, num_kv_heads, head_dim)
        elements = sum(context_lens) * num_kv_heads * head_dim * 2  # keys and values read
        for name, k_cache, v_cache in (("bf16", keys, values),
                                       ("fp8", keys.to(E4M3), values.to(E4M3))):
            attend = functools.partial(triton_attention.paged_attention, query, k_cache,
                                       v_cache, block_tables, lens, query_start_loc,
                                       head_dim**-0.5)
            bytes_read = elements * k_cache.element_size()
            if baseline is not None:
                old = functools.partial(baseline.paged_attention, *attend.args)
                for round_ in (1, 2):
                    record(f"{case} {name} default baseline round {round_}", old, bytes_read)
                    record(f"{case} {name} default current round {round_}", attend, bytes_read)
            for tile in [] if args.no_sweep else args.tiles or tiles:
                record(f"{case} {name} {tile}",
                       functools.partial(attend, decode=triton_attention.DecodeConfig(*tile)),
                       bytes_read)
            if len(context_lens) == 1:  # one sequence: fewer splits, or none (no merge)
                for splits in (1, 4, 16):
                    record(f"{case} {name} default splits {splits}",
                           functools.partial(attend, num_splits=splits), bytes_read)
    Path(os.environ.get("OUT", "."), "decode_tiles.json").write_text(json.dumps(results,
                                                                                indent=1))


if __name__ == "__main__":
    main()
