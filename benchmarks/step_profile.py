"""Where one decode step of workload (a) spends device time; writes $OUT/step_profile.json.

    python3 benchmarks/step_profile.py [--model qwen3-0.6b] [--num-seqs 256]

A decode step of ``--num-seqs`` sequences with contexts uniform in [100, 2048]
(workload (a) midway) over the full-size KV cache, its blocks either shuffled
over the whole cache or contiguous. Timed with CUDA events (median of
triton.testing.do_bench): the captured graph's replay, the eager forward,
attention alone (times the layer count), the linear layers alone, the logits,
and the sampling kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.cuda_executor import CudaModelExecutor
from trio_llm.gpu.kernels import triton_attention
from trio_llm.gpu.kernels.triton_sampling import sample_without_filters
from trio_llm.gpu.models.base import AttentionMetadata

SWEEP = [triton_attention.DecodeConfig(block_n, num_warps, num_stages)
         for block_n, num_warps, num_stages in ((64, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 4),
                                                (64, 8, 3), (32, 2, 4), (16, 2, 4))]


def bench(fn) -> float:
    return 1000 * do_bench(fn, warmup=10, rep=60, return_mode="median")  # microseconds


def decode_inputs(executor: CudaModelExecutor, context_lens: list[int], shuffled: bool):
    block_size = executor.block_size
    num_blocks = [-(-length // block_size) for length in context_lens]
    order = list(range(executor.num_kv_blocks))
    if shuffled:
        random.Random(1).shuffle(order)
    tables, start = [], 0
    for count in num_blocks:
        tables.append(order[start:start + count] + [0] * (executor.max_blocks_per_seq - count))
        start += count
    device = executor.device
    block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    lengths = torch.tensor(context_lens, dtype=torch.int64, device=device)
    positions = lengths - 1
    last_blocks = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    slot_mapping = last_blocks.long() * block_size + positions % block_size
    token_ids = torch.randint(0, 10000, (len(context_lens),), device=device)
    query_start_loc = torch.arange(len(context_lens) + 1, dtype=torch.int64, device=device)
    metadata = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables,
                                 context_lens=lengths, query_start_loc=query_start_loc)
    return token_ids, positions, metadata


def set_graph_inputs(executor: CudaModelExecutor, token_ids: torch.Tensor,
                     positions: torch.Tensor, metadata: AttentionMetadata) -> None:
    """Write a decode step's inputs where the captured graph of its size reads them."""
    num_seqs = token_ids.shape[0]
    inputs = executor.decode_graphs
    views = inputs.inputs.segments(num_seqs)
    for name, values in (("token_ids", token_ids), ("positions", positions),
                         ("slot_mapping", metadata.slot_mapping),
                         ("context_lens", metadata.context_lens)):
        views[name].copy_(values)
    inputs.block_tables[:num_seqs].copy_(metadata.block_tables)


def profile_layout(executor: CudaModelExecutor, context_lens: list[int],
                   shuffled: bool) -> dict[str, float]:
    model = executor.model
    token_ids, positions, metadata = decode_inputs(executor, context_lens, shuffled)
    num_seqs = len(context_lens)
    config = model.config
    result: dict[str, float] = {}
    with torch.inference_mode(), torch.cuda.stream(executor.compute.torch_stream):
        graph = executor.graphs.get(num_seqs)
        if graph is not None:
            set_graph_inputs(executor, token_ids, positions, metadata)
            result["graph_replay_us"] = bench(graph.graph.replay)
        result["eager_forward_us"] = bench(
            lambda: model(token_ids, positions, executor.kv_caches, metadata))
        query = torch.randn(num_seqs, config.num_heads, config.head_dim, dtype=model.dtype,
                            device=executor.device)
        k_cache, v_cache = executor.kv_caches[0]
        result["attention_all_layers_us"] = config.num_layers * bench(
            lambda: triton_attention.paged_attention(
                query, k_cache, v_cache, metadata.block_tables,
                metadata.context_lens.to(torch.int32), metadata.query_start_loc.to(torch.int32),
                config.head_dim**-0.5))
        for config_ in SWEEP:
            triton_attention.DECODE_CONFIG = config_
            result[f"attention_us_{config_.block_n}_{config_.num_warps}_{config_.num_stages}"] = (
                config.num_layers * bench(lambda: triton_attention.paged_attention(
                    query, k_cache, v_cache, metadata.block_tables,
                    metadata.context_lens.to(torch.int32),
                    metadata.query_start_loc.to(torch.int32), config.head_dim**-0.5)))
        triton_attention.DECODE_CONFIG = triton_attention.DecodeConfig()
        kv_bytes = (2 * sum(context_lens) * config.num_kv_heads * config.head_dim
                    * model.dtype.itemsize * config.num_layers)
        result["attention_gbps"] = kv_bytes / (result["attention_all_layers_us"] * 1e-6) / 1e9
        layer = model.layers[0]
        linear_us = 0.0
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            x = torch.randn(num_seqs, linear.weight.shape[1], dtype=model.dtype,
                            device=executor.device)
            linear_us += bench(lambda x=x, linear=linear: F.linear(x, linear.weight))
        result["linears_all_layers_us"] = config.num_layers * linear_us
        hidden = torch.randn(num_seqs, config.hidden_size, dtype=model.dtype,
                             device=executor.device)
        result["logits_us"] = bench(lambda: model.compute_logits(hidden))
        logits = model.compute_logits(hidden)
        temperatures = torch.full((num_seqs,), 0.6, device=executor.device)
        keys = torch.randint(0, 2**32, (num_seqs,), device=executor.device)
        indices = torch.randint(0, 1000, (num_seqs,), device=executor.device)
        result["sampling_us"] = bench(
            lambda: sample_without_filters(logits, temperatures, keys, indices))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=256)
    args = parser.parse_args()
    executor = CudaModelExecutor.create(EngineConfig(model=args.model, load_format="dummy",
                                                     device="cuda"))
    rng = random.Random(0)
    context_lens = [rng.randint(100, 2048) for _ in range(args.num_seqs)]
    results = {"model": args.model, "num_seqs": args.num_seqs,
               "mean_context_len": sum(context_lens) / len(context_lens)}
    for layout in ("shuffled", "contiguous"):
        results[layout] = profile_layout(executor, context_lens, layout == "shuffled")
        print(layout, json.dumps(results[layout], indent=1), flush=True)
    Path(os.environ.get("OUT", "."), "step_profile.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
