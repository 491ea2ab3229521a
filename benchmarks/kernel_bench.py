"""Time the Triton paged-attention kernels on the device; write $OUT/kernels.json.

    python3 benchmarks/kernel_bench.py

Each case is checked against a float64 gather reference first, then timed with
``triton.testing.do_bench`` (median of CUDA-event timings). The baseline is
torch's scaled_dot_product_attention over the same keys and values laid out
contiguously (no paging), which bounds what paging costs. Also measured: the
device-to-device copy bandwidth (bytes read plus written), the ceiling for the
memory-bound decode kernel, and whether CuPy streams, torch external streams
and graph capture on a CuPy stream work together.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from trio_llm.gpu.kernels import triton_attention

BLOCK_SIZE = 16
HEAD_DIM = 128
MODELS = {"qwen3-0.6b": (16, 8), "qwen3-8b": (32, 8)}  # (num_heads, num_kv_heads)
DECODE_CASES = [(1, 384), (64, 1024), (256, 1024), (256, 2048)]  # (num_seqs, context_len)
PREFILL_CASES = [(1, 128), (8, 1024), (16, 512)]  # fresh prompts: (num_seqs, prompt_len)
# the last 8,192-token chunk of a 32,768-token prompt (the long-prefill target's shape)
CHUNK_CASE = (1, 32768, 8192)  # (num_seqs, context_len, query_len)
VARLEN_SWEEP = [triton_attention.VarlenConfig(*shape) for shape in (
    (64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3))]
# A mixed step of the 2000 x (128 in, 64..192 out) workload: 256 decode rows (contexts
# 128 to 320) and three 128-token prompts; qwen3-0.6b.
MIXED_CASE = (256, (128, 320), 3, 128)  # (decode rows, context range, prompts, prompt len)
# One sequence decoding at a 32,000-token context (the long-decode target's shape):
# split counts and tiles of the decode kernel.
LONG_DECODE_CONTEXT = 32000
DECODE_SPLITS = (32, 64, 128)
DECODE_SWEEP = [triton_attention.DecodeConfig(*shape) for shape in (
    (128, 4, 3), (64, 4, 2), (64, 4, 3))]


def environment() -> dict:
    info = {"python": sys.version.split()[0], "platform": platform.platform(),
            "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
            "num_sms": torch.cuda.get_device_properties(0).multi_processor_count}
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except ImportError:
        info["cupy"] = None
    return info


def copy_bandwidth_gbps() -> float:
    source = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_()
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), return_mode="median")
    return 2 * source.numel() / (ms * 1e-3) / 1e9


def paged_inputs(num_seqs, context_len, query_len, num_heads, num_kv_heads):
    """Random bf16 inputs with every sequence scattered over shuffled blocks."""
    blocks_per_seq = triton.cdiv(context_len, BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_tables = block_tables.reshape(num_seqs, blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(num_seqs * query_len, num_heads, HEAD_DIM, dtype=torch.bfloat16,
                        device="cuda")
    context_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device="cuda")
    query_start_loc = torch.arange(0, num_seqs * query_len + 1, query_len, dtype=torch.int32,
                                   device="cuda")
    return query, k_cache, v_cache, block_tables, context_lens, query_start_loc


def contiguous_kv(k_cache, block_tables, context_len):
    """[num_seqs, num_kv_heads, context_len, head_dim]: the same keys, unpaged."""
    gathered = k_cache[block_tables.long()].flatten(1, 2)[:, :context_len]
    return gathered.transpose(1, 2).contiguous()


def sdpa_baseline(query, k_cache, v_cache, block_tables, context_len, query_len):
    num_seqs = block_tables.shape[0]
    keys = contiguous_kv(k_cache, block_tables, context_len)
    values = contiguous_kv(v_cache, block_tables, context_len)
    q = query.view(num_seqs, query_len, -1, HEAD_DIM).transpose(1, 2)
    return lambda: F.scaled_dot_product_attention(q, keys, values, is_causal=query_len > 1,
                                                  enable_gqa=True)


def reference(query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale):
    """Float64 attention of the first two sequences: enough to catch indexing errors."""
    num_seqs = min(2, block_tables.shape[0])
    group = query.shape[1] // k_cache.shape[2]
    outs = []
    for seq in range(num_seqs):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        context_len = int(context_lens[seq])
        positions = torch.arange(context_len, device="cuda")
        blocks = block_tables[seq, positions // BLOCK_SIZE].long()
        slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
        keys = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        values = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].double(), keys) * scale
        query_positions = context_len - (end - start) + torch.arange(end - start, device="cuda")
        scores = scores.masked_fill(positions[None, None, :] > query_positions[None, :, None],
                                    float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(outs), int(query_start_loc[num_seqs])


def time_case(kind, model, num_seqs, context_len, query_len):
    num_heads, num_kv_heads = MODELS[model]
    inputs = paged_inputs(num_seqs, context_len, query_len, num_heads, num_kv_heads)
    scale = HEAD_DIM**-0.5
    run = lambda: triton_attention.paged_attention(*inputs, scale)  # noqa: E731
    expected, num_checked = reference(*inputs, scale)
    error = ((run()[:num_checked].double() - expected).norm() / expected.norm()).item()
    ms = do_bench(run, warmup=25, rep=100, return_mode="median")
    baseline_ms = do_bench(sdpa_baseline(inputs[0], inputs[1], inputs[2], inputs[3],
                                         context_len, query_len),
                           warmup=25, rep=100, return_mode="median")
    kv_bytes = 2 * num_seqs * context_len * num_kv_heads * HEAD_DIM * 2
    return {"kind": kind, "model": model, "num_seqs": num_seqs, "context_len": context_len,
            "query_len": query_len, "relative_error": error, "triton_us": ms * 1e3,
            "sdpa_unpaged_us": baseline_ms * 1e3,
            "kv_read_gbps": kv_bytes / (ms * 1e-3) / 1e9}


def attention_flops(num_seqs, context_len, query_len, num_heads):
    """Multiply-adds x 2 of QK^T and PV over the causally visible positions."""
    visible = query_len * (context_len - query_len) + query_len * (query_len + 1) / 2
    return 4 * num_seqs * visible * num_heads * HEAD_DIM


def sweep_varlen(model, num_seqs, context_len, query_len):
    """The varlen kernel's median time per tile configuration (each checked against
    the default configuration's output)."""
    num_heads, num_kv_heads = MODELS[model]
    inputs = paged_inputs(num_seqs, context_len, query_len, num_heads, num_kv_heads)
    flops = attention_flops(num_seqs, context_len, query_len, num_heads)
    return _sweep_varlen(model, f"{num_seqs}x{query_len}/{context_len}", inputs, flops)


def mixed_inputs(model):
    """MIXED_CASE's step: decode rows, then the prompts, every sequence on its own blocks."""
    num_heads, num_kv_heads = MODELS[model]
    num_decodes, (low, high), num_prompts, prompt_len = MIXED_CASE
    generator = torch.Generator().manual_seed(0)
    contexts = torch.randint(low, high + 1, (num_decodes,), generator=generator).tolist()
    contexts += [prompt_len] * num_prompts
    query_lens = [1] * num_decodes + [prompt_len] * num_prompts
    blocks_per_seq = triton.cdiv(max(contexts), BLOCK_SIZE)
    num_seqs = len(contexts)
    num_blocks = num_seqs * blocks_per_seq
    block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    block_tables = block_tables.reshape(num_seqs, blocks_per_seq)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn(cache_shape, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(sum(query_lens), num_heads, HEAD_DIM, dtype=torch.bfloat16,
                        device="cuda")
    context_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                          dtype=torch.int32, device="cuda")
    flops = sum(attention_flops(1, context, query_len, num_heads)
                for context, query_len in zip(contexts, query_lens, strict=True))
    return (query, k_cache, v_cache, block_tables, context_lens, starts), flops


def _sweep_varlen(model, label, inputs, flops):
    scale = HEAD_DIM**-0.5
    expected = triton_attention.paged_attention(*inputs, scale).double()
    rows = []
    for config in VARLEN_SWEEP:
        run = lambda config=config: triton_attention.paged_attention(  # noqa: E731
            *inputs, scale, varlen=config)
        error = ((run().double() - expected).norm() / expected.norm()).item()
        ms = do_bench(run, warmup=25, rep=100, return_mode="median")
        rows.append({"model": model, "case": label, "config": list(dataclasses.astuple(config)),
                     "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
                     "difference_from_default": error})
        print(f"varlen {model:11} {label:16} {dataclasses.astuple(config)}: {ms * 1e3:9.1f} us "
              f"{rows[-1]['tflops']:6.1f} TFLOP/s diff {error:.1e}", flush=True)
    return rows


def sweep_long_decode(model):
    """The decode kernel on one sequence at LONG_DECODE_CONTEXT: each split count and tile;
    KV read bandwidth against the copy ceiling."""
    num_heads, num_kv_heads = MODELS[model]
    inputs = paged_inputs(1, LONG_DECODE_CONTEXT, 1, num_heads, num_kv_heads)
    scale = HEAD_DIM**-0.5
    expected = triton_attention.paged_attention(*inputs, scale, num_splits=1).double()
    kv_bytes = 2 * LONG_DECODE_CONTEXT * num_kv_heads * HEAD_DIM * 2
    rows = []
    for config in DECODE_SWEEP:
        for num_splits in DECODE_SPLITS:
            run = lambda config=config, num_splits=num_splits: (  # noqa: E731
                triton_attention.paged_attention(*inputs, scale, num_splits=num_splits,
                                                 decode=config))
            error = ((run().double() - expected).norm() / expected.norm()).item()
            ms = do_bench(run, warmup=25, rep=100, return_mode="median")
            rows.append({"model": model, "context_len": LONG_DECODE_CONTEXT,
                         "config": list(dataclasses.astuple(config)), "num_splits": num_splits,
                         "us": ms * 1e3, "kv_read_gbps": kv_bytes / (ms * 1e-3) / 1e9,
                         "difference_from_unsplit": error})
            print(f"decode {model:11} 1x{LONG_DECODE_CONTEXT} {dataclasses.astuple(config)} "
                  f"splits {num_splits:3}: {ms * 1e3:7.1f} us "
                  f"{rows[-1]['kv_read_gbps']:6.0f} GB/s diff {error:.1e}", flush=True)
    return rows


def time_kv_write(num_tokens=8192, num_kv_heads=8):
    key = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    num_blocks = num_tokens // BLOCK_SIZE * 2
    k_cache = torch.zeros(num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=torch.bfloat16,
                          device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens]
    write = lambda: triton_attention.write_kv_cache(key, value, k_cache, v_cache, slots)  # noqa: E731
    write()
    assert torch.equal(k_cache.flatten(0, 1)[slots], key)
    ms = do_bench(write, return_mode="median")
    return {"num_tokens": num_tokens, "us": ms * 1e3,
            "gbps": 4 * key.numel() * 2 / (ms * 1e-3) / 1e9}


def check_cupy_interop() -> dict:
    """Attention on a torch-owned side stream driven through CuPy: captured as a graph,
    replayed, ordered by CuPy events, read back into pinned memory on a copy stream.

    torch owns the streams (CuPy wraps them as external streams): a tensor freed
    after a CuPy-owned stream was destroyed crashes torch's allocator.
    """
    import cupy

    compute_stream, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    compute = cupy.cuda.ExternalStream(compute_stream.cuda_stream)
    copy = cupy.cuda.ExternalStream(copy_stream.cuda_stream)
    inputs = paged_inputs(4, 200, 1, 16, 8)
    expected = triton_attention.paged_attention(*inputs, 0.1)
    torch.cuda.synchronize()
    with torch.cuda.stream(compute_stream):
        eager = triton_attention.paged_attention(*inputs, 0.1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=compute_stream):
            captured = triton_attention.paged_attention(*inputs, 0.1)
        graph.replay()
    done = cupy.cuda.Event(disable_timing=True)
    done.record(compute)
    copy.wait_event(done)
    pinned = torch.empty(captured.shape, dtype=captured.dtype, pin_memory=True)
    with torch.cuda.stream(copy_stream):
        pinned.copy_(captured, non_blocking=True)
    copied = cupy.cuda.Event(disable_timing=True)
    copied.record(copy)
    copied.synchronize()
    result = {"graph_replay_matches_eager": bool(torch.equal(pinned, eager.cpu())),
              "eager_matches_default_stream": bool(torch.equal(eager, expected))}
    del graph, captured, eager
    torch.cuda.synchronize()
    return result


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "."))
    results: dict = {"environment": environment(), "copy_bandwidth_gbps": copy_bandwidth_gbps()}
    results["kv_write"] = time_kv_write()
    print(json.dumps(results, indent=1))
    results["cases"] = []
    for model in MODELS:
        for num_seqs, context_len in DECODE_CASES:
            results["cases"].append(time_case("decode", model, num_seqs, context_len, 1))
        for num_seqs, prompt_len in PREFILL_CASES:
            results["cases"].append(time_case("prefill", model, num_seqs, prompt_len, prompt_len))
        (out_dir / "kernels.json").write_text(json.dumps(results, indent=2))
    results["varlen_sweep"] = []
    for model in MODELS:
        results["varlen_sweep"] += _sweep_varlen(model, "mixed", *mixed_inputs(model))
        results["varlen_sweep"] += sweep_varlen(model, 8, 1024, 1024)
        results["varlen_sweep"] += sweep_varlen(model, *CHUNK_CASE)
        (out_dir / "kernels.json").write_text(json.dumps(results, indent=2))
    results["long_decode_sweep"] = sweep_long_decode("qwen3-0.6b")
    (out_dir / "kernels.json").write_text(json.dumps(results, indent=2))
    results["cupy_interop"] = check_cupy_interop()
    (out_dir / "kernels.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["cupy_interop"]))
    print(f"{'kind':8} {'model':11} {'seqs':>5} {'ctx':>5} {'err':>8} {'triton us':>10} "
          f"{'sdpa us':>9} {'ratio':>6} {'GB/s':>7}")
    for case in results["cases"]:
        print(f"{case['kind']:8} {case['model']:11} {case['num_seqs']:5} {case['context_len']:5} "
              f"{case['relative_error']:8.1e} {case['triton_us']:10.1f} "
              f"{case['sdpa_unpaged_us']:9.1f} "
              f"{case['triton_us'] / case['sdpa_unpaged_us']:6.2f} {case['kv_read_gbps']:7.0f}")


if __name__ == "__main__":
    main()
