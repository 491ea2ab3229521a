"""The decode attention kernel alone over a bf16 and an FP8 cache, across decode tiles.

    python3 benchmarks/decode_tiles_bench.py

One decode step of qwen3-8b's attention shape (32 query heads, 8 KV heads of 128) for
256 sequences of 100-2,048 cached tokens (seeded; graph_profile.py's contexts), their
blocks scattered over the cache. Each (block_n, num_warps, num_stages) is timed by CUDA
events (median of 20) and reported with the cache bytes it reads per second: the decode
kernel is meant to stream the cache, so a tile whose rate falls well under the copy
bandwidth is bound by something else. Writes $OUT/decode_tiles.json.
"""

from __future__ import annotations

import json
import os
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from cuda_timing import event_times_ms  # benchmarks/, the script's folder

from trio_llm.gpu.kernels import triton_attention
from trio_llm.gpu.quantization import E4M3

NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 256, 32, 8, 128, 16
TILES = [(128, 4, 3), (256, 4, 3), (256, 8, 3), (128, 8, 3), (64, 4, 3), (128, 4, 4),
         (256, 4, 2), (512, 8, 2)]


def median_us(launch: Callable[[], object], repeats: int = 20) -> float:
    launch()  # compiled outside the timing
    torch.cuda.synchronize()
    return 1000 * statistics.median(event_times_ms(launch, repeats))


def main() -> None:
    torch.manual_seed(0)
    rng = random.Random(0)
    context_lens = [rng.randint(100, 2048) for _ in range(NUM_SEQS)]
    blocks = [-(-length // BLOCK_SIZE) for length in context_lens]
    order = torch.randperm(sum(blocks))
    block_tables = torch.zeros(NUM_SEQS, max(blocks), dtype=torch.int32)
    taken = 0
    for seq, count in enumerate(blocks):
        block_tables[seq, :count] = order[taken:taken + count]
        taken += count
    block_tables = block_tables.cuda()
    lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(NUM_SEQS + 1, dtype=torch.int32, device="cuda")
    query = torch.randn(NUM_SEQS, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(sum(blocks), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda",
                       dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    caches = {"bf16": (keys, values), "fp8": (keys.to(E4M3), values.to(E4M3))}
    elements = sum(context_lens) * NUM_KV_HEADS * HEAD_DIM * 2  # keys and values read
    results: dict[str, object] = {"num_seqs": NUM_SEQS, "context_lens": "100-2048",
                                  "device": torch.cuda.get_device_name()}
    for name, (k_cache, v_cache) in caches.items():
        for tile in TILES:
            config = triton_attention.DecodeConfig(*tile)

            def launch(k_cache=k_cache, v_cache=v_cache, config=config) -> object:
                return triton_attention.paged_attention(
                    query, k_cache, v_cache, block_tables, lens, query_start_loc,
                    HEAD_DIM**-0.5, decode=config)

            key = f"{name} {tile}"
            try:
                us = median_us(launch)
                results[key] = {"us": us,
                                "gb_per_s": elements * k_cache.element_size() / us / 1e3}
            except Exception as error:  # a tile past the shared memory
                results[key] = repr(error)[:120]
            print(key, results[key], flush=True)
    Path(os.environ.get("OUT", "."), "decode_tiles.json").write_text(json.dumps(results,
                                                                                indent=1))


if __name__ == "__main__":
    main()
