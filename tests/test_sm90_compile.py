"""Every project Triton kernel compiles for the H200 (sm_90) and fits its shared memory.

No GPU needed: the triton wheel ships ptxas, so ``triton.compile`` reaches a cubin for
a GPUTarget of capability 90 on the CPU. The launches are not listed by hand: each
scenario calls the project's own wrappers (paged_attention, fused_moe, gemv, ...) on
meta tensors of a built-in model's shapes, and ``JITFunction.run`` is replaced by a
compile of exactly what the launch would have compiled (Triton's own binder picks the
signature, the specialisations and the constexprs). The tile rules therefore come from
the code (varlen_config, gemv_config, fused_moe's CONFIGS and tuned tables, ...).

The compiles run in child processes (one a core) without TRITON_INTERPRET (conftest.py turns
the interpreter on for this process, and an interpreted kernel cannot be compiled);
Triton's on-disk cache makes a second run fast. Checked: the compile, the shared
memory (227 KiB a block) and the registers of a block (64K, from cuobjdump). What
this cannot see: timing, numerics on the device, what register spills cost, and the
driver's other load-time checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")

# The H200's (and H100's) largest shared memory of one block, opted in: 227 KiB.
SHARED_MEMORY_LIMIT = 232_448
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTXAS = NVIDIA_BIN / "ptxas"
# A block's registers (64K of 32 bits on sm_90): registers a thread x threads must fit.
REGISTERS_PER_BLOCK = 65_536
MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-30b-a3b", "qwen3.5-27b", "qwen3.5-35b-a3b")
# The H200's SM count, for decode_num_splits' rule (the split count is a constexpr).
H200_SMS = 132
# Compiling processes: one a core, up to four (a cold cache is minutes of CPU).
NUM_CHILDREN = max(1, min(4, len(os.sched_getaffinity(0))))
# The models whose decode the device measured with PDL on and off (device_run.sh decode-nopdl-*).
PDL_MODELS = ("qwen3-8b", "qwen3-30b-a3b", "qwen3.5-35b-a3b")
# One rank's shapes of the tensor-parallel device runs (device_run.sh tp2-*); the
# sampler sees the gathered vocabulary, as without a split.
TP_MODELS = {"qwen3-0.6b": 2, "qwen3-8b": 2}
META = torch.device("meta")
BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn


# -- scenarios: the project's wrappers on meta tensors of a model's shapes ----------------


def _config(model: str) -> dict[str, Any]:
    """A built-in model's config.json; ``NAME,tp=N``: one rank's shard of it under tensor
    parallelism (gpu/tensor_parallel.py: its heads, intermediate and vocabulary slices)."""
    from trio_llm.gpu.builtin import DUMMY_ONLY_CONFIGS

    name, _, shard = model.partition(",tp=")
    config = DUMMY_ONLY_CONFIGS[name]
    if not shard:
        return config
    ranks = int(shard)
    return config | {key: triton.cdiv(config[key], ranks) for key in (
        "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")}


def _empty(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _is_hybrid(config: dict[str, Any]) -> bool:
    return "linear_num_value_heads" in config


@contextmanager
def _h200_properties() -> Iterator[None]:
    """torch.cuda's device properties answer as an H200's (for decode_num_splits)."""
    class Properties:
        multi_processor_count = H200_SMS

    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: Properties()  # type: ignore
    try:
        yield
    finally:
        torch.cuda.get_device_properties = original  # type: ignore


def _attention(model: str) -> None:
    """Decode (one sequence: the most splits; and a full batch: one split) and varlen
    (varlen_config's tiles at both of its token counts), over a bf16 and an FP8 cache."""
    from trio_llm.gpu.kernels import triton_attention as attention

    config = _config(model)
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    block_size, num_seqs = 16, 256
    for cache_dtype in (BF16, E4M3):
        k_cache = _empty(1024, block_size, kv_heads, head_dim, dtype=cache_dtype)
        key = _empty(num_seqs, kv_heads, head_dim)
        attention.write_kv_cache(key, key, k_cache, k_cache, _empty(num_seqs, dtype=torch.int64))
        for seqs in (1, num_seqs):
            with _h200_properties():
                splits = attention.decode_num_splits(seqs, kv_heads, torch.device("cuda"))
            attention.paged_attention(
                _empty(seqs, heads, head_dim), k_cache, k_cache,
                _empty(seqs, 64, dtype=torch.int32), _empty(seqs, dtype=torch.int32),
                _empty(seqs + 1, dtype=torch.int32), 0.1, num_splits=splits)
        for tokens in (attention.VARLEN_SMALL_MAX_TOKENS, 2 * attention.VARLEN_SMALL_MAX_TOKENS):
            attention.paged_attention(
                _empty(tokens, heads, head_dim), k_cache, k_cache,
                _empty(4, 512, dtype=torch.int32), _empty(4, dtype=torch.int32),
                _empty(5, dtype=torch.int32), 0.1)


def _qk_and_norms(model: str) -> None:
    """The layer's norms (hidden size, with and without the residual, FP8 output) and
    its q/k norm + rotary + KV write (plain or gated)."""
    from trio_llm.gpu.kernels import triton_gated_attention, triton_layers, triton_offset_norm

    config = _config(model)
    hidden, heads, kv_heads, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                         config["num_key_value_heads"], config["head_dim"])
    tokens = 64
    x, weight = _empty(tokens, hidden), _empty(hidden)
    if _is_hybrid(config):
        triton_offset_norm.offset_rms_norm(x, weight, 1e-6)
        triton_offset_norm.add_offset_rms_norm(x, x, weight, 1e-6)
        rotary = int(head_dim * config["rope_parameters"]["partial_rotary_factor"])
        qkv = _empty(tokens, heads * 2 * head_dim + 2 * kv_heads * head_dim)
        for cache_dtype in (BF16, E4M3):
            k_cache = _empty(64, 16, kv_heads, head_dim, dtype=cache_dtype)
            triton_gated_attention.gated_qk_norm_rope_write_kv(
                qkv, _empty(tokens, dtype=torch.int64), _empty(128, rotary),
                _empty(128, rotary), _empty(head_dim), _empty(head_dim), 1e-6, k_cache,
                k_cache, _empty(tokens, dtype=torch.int64), num_heads=heads,
                num_kv_heads=kv_heads, head_dim=head_dim)
        triton_gated_attention.sigmoid_gate(_empty(tokens, heads, head_dim), qkv)
        return
    triton_layers.rms_norm(x, weight, 1e-6)
    triton_layers.add_rms_norm(x, x, weight, 1e-6)
    triton_layers.rms_norm_fp8(x, None, weight, 1e-6)
    triton_layers.rms_norm_fp8(x, x, weight, 1e-6)
    triton_layers.silu_and_mul(_empty(tokens, 2 * config["intermediate_size"]))
    triton_layers.silu_and_mul_fp8(_empty(tokens, 2 * config["intermediate_size"]))
    qkv = _empty(tokens, (heads + 2 * kv_heads) * head_dim)
    for cache_dtype in (BF16, E4M3):
        k_cache = _empty(64, 16, kv_heads, head_dim, dtype=cache_dtype)
        triton_layers.qk_norm_rope_write_kv(
            qkv, _empty(tokens, dtype=torch.int64), _empty(128, head_dim // 2),
            _empty(128, head_dim // 2), _empty(head_dim), _empty(head_dim), 1e-6, k_cache,
            k_cache, _empty(tokens, dtype=torch.int64), num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim)


def _linear_shapes(config: dict[str, Any]) -> set[tuple[int, int]]:
    """(outputs, inputs) of the model's linear layers that a decode step may run as GEMVs."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    query_width = heads * head_dim * (2 if _is_hybrid(config) else 1)  # (the gated query)
    shapes = {(query_width + 2 * kv_heads * head_dim, hidden), (hidden, heads * head_dim),
              (config["vocab_size"], hidden)}
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in config:
            shapes |= {(2 * config[key], hidden), (hidden, config[key])}
    if "num_experts" in config:
        shapes.add((_stacked_experts(config), hidden))  # the router
    if _is_hybrid(config):
        keys = config["linear_num_key_heads"] * config["linear_key_head_dim"]
        values = config["linear_num_value_heads"] * config["linear_value_head_dim"]
        shapes |= {(2 * keys + 2 * values, hidden), (2 * config["linear_num_value_heads"], hidden),
                   (hidden, values)}
    return shapes


def _gemv(model: str) -> None:
    """gemv for each linear layer's shape, at 1 to GEMV_ROWS rows: bf16, and e4m3 with
    per-channel and 128 x 128 block scales; a gate/up projection's with its SwiGLU too."""
    from trio_llm.gpu.kernels import triton_gemv

    config = _config(model)
    gate_ups = {(2 * config[key], config["hidden_size"])
                for key in ("intermediate_size", "shared_expert_intermediate_size")
                if key in config}
    for outputs, inputs in sorted(_linear_shapes(config)):
        for rows in range(1, triton_gemv.GEMV_ROWS + 1):
            for swiglu in (False, True) if (outputs, inputs) in gate_ups else (False,):
                x = _empty(rows, inputs)
                triton_gemv.gemv(x, _empty(outputs, inputs), swiglu=swiglu)
                fp8 = _empty(outputs, inputs, dtype=E4M3)
                triton_gemv.gemv(x, fp8, weight_scale=_empty(outputs, 1, dtype=torch.float32),
                                 swiglu=swiglu)
                block_scales = _empty(triton.cdiv(outputs, 128), triton.cdiv(inputs, 128),
                                      dtype=torch.float32)
                triton_gemv.gemv(x, fp8, weight_scale=block_scales, block_size=(128, 128),
                                 swiglu=swiglu)


def _fp8_gemm(model: str) -> None:
    """Per-token and 128-column quantization, the block-scaled GEMM at both tiles, and the
    row-wise Triton GEMM."""
    from trio_llm.gpu.kernels import fp8_gemm

    config = _config(model)
    hidden = config["hidden_size"]
    outputs = 2 * config.get("intermediate_size", config.get("moe_intermediate_size", hidden))
    for rows in (fp8_gemm.SMALL_M_MAX_ROWS, 4 * fp8_gemm.SMALL_M_MAX_ROWS):
        x = _empty(rows, hidden)
        fp8_gemm.quantize_groups(x)
        fp8_gemm.block_scaled_linear(
            x, _empty(outputs, hidden, dtype=E4M3),
            _empty(triton.cdiv(outputs, 128), triton.cdiv(hidden, 128), dtype=torch.float32),
            (128, 128), None)
    _rowwise_gemm(fp8_gemm.ROWWISE_MAX_ROWS, outputs, hidden, fp8_gemm.ROWWISE_CONFIG)


def _fp8_block_gemm_narrow_blocks() -> None:
    """The block-scaled GEMM at every block width the loader keeps in e4m3 (a power of
    two from MIN_BLOCK_COLUMNS; cuBLASLt takes 128 x 128 only), at both tiles."""
    from trio_llm.gpu.fp8_weights import MIN_BLOCK_COLUMNS
    from trio_llm.gpu.kernels import fp8_gemm

    hidden, outputs = 256, 512
    width = MIN_BLOCK_COLUMNS
    while width <= 128:
        for rows in (fp8_gemm.SMALL_M_MAX_ROWS, 4 * fp8_gemm.SMALL_M_MAX_ROWS):
            values, scales = fp8_gemm.quantize_groups(_empty(rows, hidden), width)
            fp8_gemm.block_fp8_matmul(
                values, scales, _empty(outputs, hidden, dtype=E4M3),
                _empty(outputs // width, hidden // width, dtype=torch.float32),
                (width, width), None, BF16)
        width *= 2


def _rowwise_gemm(rows: int, outputs: int, inputs: int, tile: Any) -> None:
    from trio_llm.gpu.kernels import fp8_gemm

    scales = torch.float32
    fp8_gemm.rowwise_fp8_matmul(
        _empty(rows, inputs, dtype=E4M3), _empty(rows, 1, dtype=scales),
        _empty(outputs, inputs, dtype=E4M3), _empty(outputs, 1, dtype=scales), None, BF16,
        tile)


def _rowwise_gemm_tables() -> None:
    """Every tile of the row-wise GEMM's tuned tables (any device) at its weight's shape
    and the largest row count it serves."""
    from trio_llm.gpu.kernels import fp8_gemm

    for path in sorted(fp8_gemm.BUILTIN_CONFIGS.glob("*.json")):
        shape = json.loads(path.read_text())["shape"]
        tiles: dict[Any, int] = {}
        for rows, tile in fp8_gemm.read_table(path):
            if tile is not None:
                tiles[tile] = rows  # sorted by rows: the last is the largest
        for tile, rows in tiles.items():
            _rowwise_gemm(rows, shape["out"], shape["in"], tile)


def _moe_tables(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype,
                block: tuple[int, int] | None = None) -> list[tuple[int, Any]]:
    """The default table and every tuned table of this layer shape, dtype and FP8 scale
    blocks (any device)."""
    from trio_llm.gpu.kernels import fused_moe

    entries = list(fused_moe.CONFIGS)
    pattern = fused_moe.tuned_table_name(num_experts, hidden, intermediate, dtype, "*", block)
    for path in sorted(fused_moe.BUILTIN_CONFIGS.glob(pattern)):
        entries += fused_moe.read_table(path)
    return entries


def _stacked_experts(config: dict[str, Any]) -> int:
    """The experts an MoE layer stacks: one more where the shared expert is as wide as a
    routed one (gpu/layers/moe.py)."""
    from trio_llm.gpu.layers.moe import stacks_shared_expert

    return config["num_experts"] + stacks_shared_expert(
        config["moe_intermediate_size"], config.get("shared_expert_intermediate_size", 0))


def _fused_moe(model: str, dtype: torch.dtype, block: tuple[int, int] | None = None) -> None:
    """Every configuration of the MoE tables at a token count it serves (the row-wise
    and grouped paths, the alignment at both sizes), bf16 or FP8 (``block`` scales, or
    one a row: None)."""
    from trio_llm.gpu.kernels import fused_moe, moe_routing

    config = _config(model)
    experts, top_k, hidden = (_stacked_experts(config), config["num_experts_per_tok"],
                              config["hidden_size"])
    shared = experts > config["num_experts"]
    intermediate = config["moe_intermediate_size"]
    w13, w2 = _empty(experts, 2 * intermediate, hidden, dtype=dtype), _empty(
        experts, hidden, intermediate, dtype=dtype)
    scales = None
    if dtype == E4M3:
        rows, columns = block or (1, 0)
        scales = fused_moe.ExpertScales(
            _empty(experts, triton.cdiv(2 * intermediate, rows),
                   triton.cdiv(hidden, columns) if block else 1, dtype=torch.float32),
            _empty(experts, triton.cdiv(hidden, rows),
                   triton.cdiv(intermediate, columns) if block else 1, dtype=torch.float32),
            block)
    for max_tokens, moe_config in _moe_tables(experts, hidden, intermediate, dtype, block):
        tokens = min(max_tokens, 8192)
        logits = _empty(tokens, experts)
        for round_to_input in (False, True):
            weights, ids = moe_routing.route_topk(logits, top_k, normalize=True,
                                                  round_to_input=round_to_input, shared=shared)
        fused_moe.fused_moe(_empty(tokens, hidden), w13, w2, weights, ids, config=moe_config,
                            scales=scales)


def _sampling(model: str) -> None:
    from trio_llm.gpu.kernels import triton_bitmask, triton_sampling

    vocab, rows = _config(model)["vocab_size"], 8
    logits = _empty(rows, vocab, dtype=torch.float32)
    temperatures = _empty(rows, dtype=torch.float32)
    seeds, indices = _empty(rows, dtype=torch.int64), _empty(rows, dtype=torch.int64)
    triton_sampling.sample_without_filters(logits, temperatures, seeds, indices)
    penalties = triton_sampling.KernelPenalties(
        _empty(rows, dtype=torch.int64), temperatures, temperatures, temperatures,
        _empty(16, vocab, dtype=torch.int32), _empty(16, vocab, dtype=torch.bool))
    triton_sampling.sample_without_filters(logits, temperatures, seeds, indices, penalties)
    triton_bitmask.apply_token_bitmasks_inplace(
        logits, _empty(rows, dtype=torch.int64),
        _empty(rows, triton.cdiv(vocab, 32), dtype=torch.int32))


def _linear_attention(model: str) -> None:
    """The Gated DeltaNet layer's kernels: conv1d (varlen and decode), gates, the decode
    rule (plain and VARLEN), the states' gather and scatter, the gated norm."""
    from trio_llm.gpu.kernels import triton_linear_attention as linear

    config = _config(model)
    key_heads, key_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    value_heads, value_dim = config["linear_num_value_heads"], config["linear_value_head_dim"]
    width = config["linear_conv_kernel_dim"]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    seqs, tokens, slots = 8, 64, 16
    int32 = torch.int32
    conv_state = _empty(slots, channels, width - 1)
    starts, lens, seq_slots = _empty(seqs + 1, dtype=int32), _empty(seqs, dtype=int32), _empty(
        seqs, dtype=int32)
    linear.causal_conv1d_varlen(_empty(tokens, channels), _empty(channels, 1, width), None,
                                conv_state, starts, lens, seq_slots)
    linear.causal_conv1d_decode(_empty(seqs, channels), _empty(channels, 1, width), None,
                                conv_state, lens, seq_slots)
    gates = _empty(tokens, value_heads)
    linear.gdn_gates(gates, gates, _empty(value_heads, dtype=torch.float32),
                     _empty(value_heads))
    state = _empty(slots, value_heads, key_dim, value_dim, dtype=torch.float32)
    for rows, query_start_loc in ((seqs, None), (tokens, starts)):
        q = _empty(rows, key_heads, key_dim)
        linear.gated_delta_rule_decode(
            q, q, _empty(rows, value_heads, value_dim), _empty(rows, value_heads),
            _empty(rows, value_heads), _empty(value_heads, dtype=torch.float32),
            _empty(value_heads), state, lens, seq_slots, 0.1, query_start_loc)
    dense = linear.gather_states(state, starts, lens, seq_slots)
    linear.scatter_states(dense, state, seq_slots)
    x = _empty(tokens, value_heads, value_dim)
    linear.gated_rms_norm(x, x, _empty(value_dim), 1e-6)


def _pdl(model: str) -> None:
    """With PDL on, as on the device by default (gpu/kernels/pdl.py): the
    kernels of a decode step's chain launched with PDL (the norms, the q/k norm and
    KV write, the attention, the GEMVs, the SwiGLU; for an MoE model the routing and
    the MoE kernels; for a hybrid one the linear attention's)."""
    from trio_llm.gpu.kernels import pdl, triton_layers

    config = _config(model)
    hidden = config["hidden_size"]
    original = pdl.pdl_enabled
    pdl.pdl_enabled = lambda device: True  # type: ignore[assignment]  (pdl_launch reads it)
    try:
        x, weight = _empty(1, hidden), _empty(hidden)
        triton_layers.rms_norm(x, weight, 1e-6)
        triton_layers.add_rms_norm(x, x, weight, 1e-6)
        _gemv(model)
        _qk_and_norms(model)
        _attention(model)
        if "num_experts" in config:
            _fused_moe(model, BF16)
        if _is_hybrid(config):
            _linear_attention(model)
    finally:
        pdl.pdl_enabled = original  # type: ignore[assignment]


def _scenarios() -> dict[str, Callable[[], None]]:
    """Scenario id -> a call of the project's wrappers; a failure names the id."""
    from functools import partial

    scenarios: dict[str, Callable[[], None]] = {}
    for model in MODELS:
        config = _config(model)
        for name, run in (("attention", _attention), ("qk-and-norms", _qk_and_norms),
                          ("gemv", _gemv), ("fp8-gemm", _fp8_gemm), ("sampling", _sampling)):
            scenarios[f"{name}[{model}]"] = partial(run, model)
        if "num_experts" in config:
            scenarios[f"fused-moe-bf16[{model}]"] = partial(_fused_moe, model, BF16)
            scenarios[f"fused-moe-fp8[{model}]"] = partial(_fused_moe, model, E4M3, (128, 128))
            scenarios[f"fused-moe-fp8-rows[{model}]"] = partial(_fused_moe, model, E4M3)
        if model in TP_MODELS:
            shard = f"{model},tp={TP_MODELS[model]}"
            for name, run in (("attention", _attention), ("qk-and-norms", _qk_and_norms),
                              ("gemv", _gemv), ("fp8-gemm", _fp8_gemm)):
                scenarios[f"{name}[{shard}]"] = partial(run, shard)
        if model in PDL_MODELS:
            scenarios[f"pdl[{model}]"] = partial(_pdl, model)
        if _is_hybrid(config):
            scenarios[f"linear-attention[{model}]"] = partial(_linear_attention, model)
    scenarios["fp8-gemm-tables"] = _rowwise_gemm_tables
    scenarios["fp8-block-gemm-narrow-blocks"] = _fp8_block_gemm_narrow_blocks
    scenarios[PAST_BUG] = _large_varlen_tile_at_head_dim_256
    return scenarios


def _large_varlen_tile_at_head_dim_256() -> None:
    """A launch the code no longer makes (varlen_config gives heads of 256 a tile of their own):
    the tile that was found past the limit only on the device."""
    from trio_llm.gpu.kernels import triton_attention as attention

    k_cache = _empty(64, 16, 4, 256)
    attention.paged_attention(
        _empty(8192, 24, 256), k_cache, k_cache, _empty(4, 512, dtype=torch.int32),
        _empty(4, dtype=torch.int32), _empty(5, dtype=torch.int32), 0.1,
        varlen=attention.VARLEN_LARGE_CONFIG)


# Not a launch of the code: the check's own test, that it catches what the device did.
PAST_BUG = "past-bug:varlen-large-tile[head_dim=256]"
ALL_SCENARIOS = list(_scenarios())
SCENARIO_IDS = [name for name in ALL_SCENARIOS if name != PAST_BUG]


# -- the child: record each launch, compile it for sm_90 ----------------------------------


def _compile_scenarios(names: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Run ``names`` with JITFunction.run compiling each launch for sm_90 instead."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiled: dict[str, dict[str, Any]] = {}
    launches: list[dict[str, Any]] = []

    def compile_launch(kernel: JITFunction, *args: Any, grid: Any, warmup: bool,
                       **kwargs: Any) -> None:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options)
        param_names = {(param.num,): param.name for param in kernel.params}
        values = {param_names.get(path, str(path)): value
                  for path, value in constexprs.items()}
        key = repr((kernel.fn.__qualname__, signature, constexprs, attrs, options))
        if key not in compiled:
            record: dict[str, Any] = {
                "kernel": f"{kernel.fn.__module__}.{kernel.fn.__qualname__}",
                "constexprs": {name: repr(value) for name, value in values.items()},
                "num_warps": options.num_warps, "num_stages": options.num_stages,
                "max_registers": options.maxnreg}
            try:
                binary = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                        target=target, options=options.__dict__)
                record["shared"] = binary.metadata.shared
                record |= _resource_usage(binary.asm["cubin"])
            except Exception as error:  # a compile error is the finding itself
                record["error"] = f"{type(error).__name__}: {error}"[:2000]
            compiled[key] = record
        launches.append(compiled[key])

    JITFunction.run = compile_launch  # type: ignore[method-assign]
    scenarios = _scenarios()
    results: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        launches = []
        try:
            scenarios[name]()
        except Exception as error:
            launches.append({"kernel": "(scenario)", "constexprs": {},
                             "error": f"{type(error).__name__}: {error}"[:2000]})
        results[name] = launches
    return results


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers a thread, stack and local memory (spills) from cuobjdump, which the wheel
    ships beside ptxas ({} where it is missing)."""
    import re
    import tempfile

    cuobjdump = NVIDIA_BIN / "cuobjdump"
    if not cuobjdump.is_file():
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(cuobjdump), "--dump-resource-usage", file.name],
                                capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", file.name], capture_output=True,
                              text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", report)
    if found is None:
        return {}
    registers, stack, local = map(int, found.groups())
    return {"registers": registers, "stack": stack, "local": local,
            "loop_spills": _loop_spills(sass)}


def _loop_spills(sass: str) -> int:
    """Stack loads and stores (STL, LDL) inside the kernel's loops: the instructions from
    a backward branch's target to the branch."""
    import re

    instructions = [(int(address, 16), text) for address, text in
                    re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spills = 0
    for address, text in instructions:
        targets = re.findall(r"0x([0-9a-f]+)", text) if "BRA" in text else []
        if targets and int(targets[-1], 16) < address:
            start = int(targets[-1], 16)
            spills += sum(bool(re.search(r"\b(STL|LDL)\b", body))
                          for at, body in instructions if start <= at <= address)
    return spills


# -- the test ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sm90_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every scenario compiled, split over NUM_CHILDREN processes."""
    if not PTXAS.is_file():
        pytest.skip(f"no ptxas in the triton wheel ({PTXAS})")
    folder = tmp_path_factory.mktemp("sm90")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    children = []
    for index in range(NUM_CHILDREN):
        out = folder / f"results-{index}.json"
        names = ALL_SCENARIOS[index::NUM_CHILDREN]
        children.append((out, subprocess.Popen(
            [sys.executable, __file__, str(out), *names], env=env, stderr=subprocess.PIPE,
            text=True)))
    results: dict[str, list[dict[str, Any]]] = {}
    for out, child in children:
        _, stderr = child.communicate(timeout=900)
        assert child.returncode == 0, stderr[-4000:]
        results |= json.loads(out.read_text())
    return results


def _describe(launch: dict[str, Any]) -> str:
    constexprs = ", ".join(f"{name}={value}" for name, value in launch["constexprs"].items())
    return (f"{launch['kernel']}({constexprs}) num_warps={launch.get('num_warps')} "
            f"num_stages={launch.get('num_stages')} registers={launch.get('registers')}")


@pytest.mark.parametrize("scenario", SCENARIO_IDS)
def test_kernels_compile_for_sm90_within_shared_memory(scenario, sm90_results):
    launches = sm90_results[scenario]
    assert launches, f"{scenario} launched no kernel"
    failures = [f"{_describe(launch)}: {launch['error']}" for launch in launches
                if "error" in launch]
    failures += [f"{_describe(launch)}: {launch['shared']} bytes of shared memory, past "
                 f"{SHARED_MEMORY_LIMIT}" for launch in launches
                 if launch.get("shared", 0) > SHARED_MEMORY_LIMIT]
    failures += [f"{_describe(launch)}: {launch['registers']} registers x "
                 f"{32 * launch['num_warps']} threads, past {REGISTERS_PER_BLOCK}"
                 for launch in launches
                 if launch.get("registers", 0) * 32 * launch["num_warps"] > REGISTERS_PER_BLOCK]
    assert not failures, "\n".join(failures)


def test_the_check_catches_the_large_varlen_tile_at_head_dim_256(sm90_results):
    """The varlen tile that once needed 320 KiB at head_dim 256 (found only on the
    device) fails here; the code's own launches at 256 take the wide heads' tile."""
    from trio_llm.gpu.kernels.triton_attention import VARLEN_WIDE_HEAD_CONFIG

    (launch,) = sm90_results[PAST_BUG]
    assert launch["shared"] > SHARED_MEMORY_LIMIT, _describe(launch)
    varlen = [launch for launch in sm90_results["attention[qwen3.5-27b]"]
              if launch["kernel"].endswith("_varlen_kernel")]
    assert varlen and all(launch["constexprs"]["BLOCK_N"] == str(VARLEN_WIDE_HEAD_CONFIG.block_n)
                          for launch in varlen)


@pytest.mark.parametrize("scenario", [name for name in SCENARIO_IDS
                                      if name.startswith(("attention[", "pdl["))])
def test_the_decode_attention_keeps_its_values_in_registers(scenario, sm90_results):
    """No decode or merge launch spills to the stack: at head_dim 256 the decode kernel's
    128-position tile did (200-408 bytes a thread, the hybrid family's single-stream
    attention), and so did the merge of 64 splits in two warps (72 bytes). A launch
    whose registers are capped (the e4m3 batch tile: four programs an SM, measured
    faster) may spill outside its loop, never inside."""
    spilling = [f"{_describe(launch)} stack={launch['stack']} "
                f"in loops={launch.get('loop_spills')}"
                for launch in sm90_results[scenario]
                if launch["kernel"].endswith(("._decode_kernel", "._merge_splits_kernel"))
                and (launch.get("loop_spills", 0) > 0
                     or launch.get("stack", 0) > 0 and launch.get("max_registers") is None)]
    assert not spilling, "\n".join(spilling)


def test_the_loop_spill_count_finds_a_spill_in_a_loop():
    """The count the test above relies on: a stack access between a backward branch and
    its target counts, one outside any loop does not."""
    sass = """
        /*0000*/ STL [R1], R2 ;
        /*0010*/ LDL R3, [R1] ;
        /*0020*/ IADD3 R4, R4, 0x1, RZ ;
        /*0030*/ @P0 BRA 0x10 ;
        /*0040*/ STL [R1+0x4], R5 ;
    """
    assert _loop_spills(sass) == 1


if __name__ == "__main__":
    started = time.monotonic()
    # (run by hand: ``env -u TRITON_INTERPRET python tests/test_sm90_compile.py OUT.json``
    # writes every launch's shared memory, registers and stack (spills) to OUT.json)
    output = _compile_scenarios(sys.argv[2:] or ALL_SCENARIOS)
    Path(sys.argv[1]).write_text(json.dumps(output, indent=1))
    print(f"{len(output)} scenarios in {time.monotonic() - started:.1f} s", file=sys.stderr)
