"""The varlen attention kernel at head_dim 256 (the hybrid family's full attention) across
tiles, over a bf16 and an FP8 cache.

    python3 benchmarks/varlen_wide_heads.py

The tile for heads of 256 was chosen by this benchmark: 64 query rows x 64
positions in 4 warps, the small tile of heads of 128, spilled registers to the stack
in its sm_90 code (80-192 bytes a thread), and 64 x 32 (varlen_config's tile for wide
heads now) ran fastest of the five on an H100 (docs/performance.md). Three steps with
qwen3.5-27b's heads (24 query heads, 4 KV heads of 256): the last 8,192-token chunk of
a 32,768-token prompt, 8 fresh prompts of 1,024 tokens, and a mixed step of 256 decode
rows (contexts 128-320) with three 128-token prompts. Each tile is timed by CUDA events
around a graph of ten launches (median of 20 replays, cuda_timing.py's
``graph_launch_us``); the output is checked against the first tile's (64 x 64). Writes
$OUT/varlen_wide_heads.json.
"""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path

import torch
from cuda_timing import graph_launch_us  # benchmarks/, the script's folder
from decode_tiles_bench import BLOCK_SIZE, scattered_block_tables

from trio_llm.gpu.kernels import triton_attention
from trio_llm.gpu.quantization import E4M3

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS = 256, 24, 4
TILES = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)]
_rng = random.Random(0)
# name: [(context length, query length)] per sequence
STEPS = {
    "chunk-8192-of-32768": [(32768, 8192)],
    "prompts-8x1024": [(1024, 1024)] * 8,
    "mixed-256-decode-3-prompts": [(_rng.randint(128, 320), 1) for _ in range(256)]
                                  + [(128, 128)] * 3,
}


def step_inputs(sequences: list[tuple[int, int]]):
    """(query, keys, values, block tables, context lens, query_start_loc), each
    sequence's blocks scattered over the cache."""
    block_tables, num_blocks = scattered_block_tables([context for context, _ in sequences])
    query_lens = [query for _, query in sequences]
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, device="cuda",
                        dtype=torch.bfloat16)
    keys = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                       dtype=torch.bfloat16)
    return (query, keys, torch.randn_like(keys), block_tables,
            torch.tensor([context for context, _ in sequences], dtype=torch.int32,
                         device="cuda"), starts.cuda())


def main() -> None:
    torch.manual_seed(0)
    results: dict[str, object] = {"device": torch.cuda.get_device_name()}
    for step, sequences in STEPS.items():
        query, keys, values, block_tables, lens, starts = step_inputs(sequences)
        for name, k_cache, v_cache in (("bf16", keys, values),
                                       ("fp8", keys.to(E4M3), values.to(E4M3))):
            attend = functools.partial(triton_attention.paged_attention, query, k_cache,
                                       v_cache, block_tables, lens, starts, HEAD_DIM**-0.5)
            expected = attend(varlen=triton_attention.VarlenConfig(*TILES[0])).float()
            for tile in TILES:
                launch = functools.partial(attend, varlen=triton_attention.VarlenConfig(*tile))
                key = f"{step} {name} {tile}"
                try:
                    error = (launch().float() - expected).abs().max().item()
                    results[key] = {"us": graph_launch_us(launch), "max_abs_difference": error}
                except Exception as failure:  # a tile past the shared memory
                    results[key] = repr(failure)[:120]
                print(key, results[key], flush=True)
    Path(os.environ.get("OUT", "."), "varlen_wide_heads.json").write_text(
        json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
