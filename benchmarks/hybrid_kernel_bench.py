"""The hybrid family's linear-attention kernels on the GPU, at qwen3.5-35b-a3b's heads.

    python3 benchmarks/hybrid_kernel_bench.py   # JSON under $OUT

- decode of the gated delta rule, one token per sequence, at batch 1, 64 and 256:
  trio-llm's kernel (gpu/kernels/triton_linear_attention.py: the state updated in
  place in its slot, the gates computed inside) against fla-core's
  ``fused_recurrent_gated_delta_rule`` with the states gathered from their slots and
  scattered back (fla 0.6.0 has no in-place slot indexing), gates by ``gdn_gates``:
  microseconds a layer, the states' bytes moved per second, and the largest difference
  between the two outputs and states;
- the causal conv1d: decode at batch 256, varlen over 8,192 tokens;
- fla's chunked rule through the slots (gpu/kernels/fla_gated_delta_rule.py) on one
  8,192-token prompt and on 8 prompts of 1,024;
- a served mixed step (63 decode rows and one 1,024-token chunk in a graph's layout of
  1,088 tokens and 257 sequence slots): every slot through fla's chunked rule (the
  path before the compaction) against ``mixed_gated_delta_rule`` (decode rows in
  place, the chunk on MAX_CHUNKED_SEQS seats), and their largest differences.

Device time per call by CUDA events, median of 50 after 5 warm calls.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from cuda_timing import event_times_ms

from trio_llm.actors.config import MAX_CHUNKED_SEQS
from trio_llm.gpu.kernels import triton_linear_attention as kernels
from trio_llm.gpu.kernels.fla_gated_delta_rule import (
    chunked_gated_delta_rule,
    mixed_gated_delta_rule,
)

OUT = Path(os.environ.get("OUT", "."))
KEY_HEADS, VALUE_HEADS, DIM = 16, 32, 128  # qwen3.5-35b-a3b's linear attention
CONV_CHANNELS = 2 * KEY_HEADS * DIM + VALUE_HEADS * DIM
DEVICE = torch.device("cuda")
DTYPE = torch.bfloat16


def device_us(function: Callable[[], Any], repeats: int = 50) -> float:
    for _ in range(5):
        function()
    return statistics.median([1000 * ms for ms in event_times_ms(function, repeats)])


def decode_case(batch: int) -> dict[str, Any]:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    generator = torch.Generator(device=DEVICE).manual_seed(batch)

    def random(*shape: int, dtype: torch.dtype = DTYPE) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=DEVICE).to(dtype)

    num_slots = batch + 8
    mixed = random(batch, CONV_CHANNELS)
    query = mixed[:, :KEY_HEADS * DIM].unflatten(1, (KEY_HEADS, DIM))
    key = mixed[:, KEY_HEADS * DIM:2 * KEY_HEADS * DIM].unflatten(1, (KEY_HEADS, DIM))
    value = mixed[:, 2 * KEY_HEADS * DIM:].unflatten(1, (VALUE_HEADS, DIM))
    a, b = random(batch, VALUE_HEADS), random(batch, VALUE_HEADS)
    a_log, dt_bias = random(VALUE_HEADS, dtype=torch.float32), random(VALUE_HEADS,
                                                                     dtype=torch.float32)
    states = random(num_slots, VALUE_HEADS, DIM, DIM, dtype=torch.float32) * 0.05
    slots = torch.randperm(num_slots, device=DEVICE)[:batch]
    context_lens = torch.full((batch,), 100, dtype=torch.int64, device=DEVICE)
    scale = DIM ** -0.5
    ours_states, theirs_states = states.clone(), states.clone()

    def ours() -> torch.Tensor:
        return kernels.gated_delta_rule_decode(query, key, value, a, b, a_log, dt_bias,
                                               ours_states, context_lens, slots, scale)

    def theirs() -> torch.Tensor:
        g, beta = kernels.gdn_gates(a, b, a_log, dt_bias)
        initial = theirs_states.index_select(0, slots)
        out, final = fused_recurrent_gated_delta_rule(
            query[:, None], key[:, None], value[:, None], g=g[:, None], beta=beta[:, None],
            scale=scale, initial_state=initial, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        theirs_states.index_copy_(0, slots, final)
        return out[:, 0]

    difference = (ours().float() - theirs().float()).abs().max().item()
    state_difference = (ours_states - theirs_states).abs().max().item()
    state_bytes = 2 * batch * VALUE_HEADS * DIM * DIM * 4  # read and written once
    ours_us, theirs_us = device_us(ours), device_us(theirs)
    return {"batch": batch, "ours_us": ours_us, "fla_gather_scatter_us": theirs_us,
            "ours_state_tb_per_s": state_bytes / ours_us / 1e6,
            "fla_state_tb_per_s": state_bytes / theirs_us / 1e6,
            "max_output_difference": difference, "max_state_difference": state_difference}


def conv_cases() -> dict[str, Any]:
    weight = torch.randn(CONV_CHANNELS, 4, device=DEVICE).to(DTYPE)
    states = torch.randn(264, CONV_CHANNELS, 3, device=DEVICE).to(DTYPE)
    batch = 256
    x = torch.randn(batch, CONV_CHANNELS, device=DEVICE).to(DTYPE)
    slots = torch.arange(batch, device=DEVICE)
    context_lens = torch.full((batch,), 100, dtype=torch.int64, device=DEVICE)
    decode_us = device_us(lambda: kernels.causal_conv1d_decode(x, weight, None, states,
                                                               context_lens, slots))
    tokens = torch.randn(8192, CONV_CHANNELS, device=DEVICE).to(DTYPE)
    starts = torch.tensor([0, 8192], device=DEVICE)
    varlen_us = device_us(lambda: kernels.causal_conv1d_varlen(
        tokens, weight, None, states, starts, starts[1:], slots[:1]))
    return {"conv_decode_batch_256_us": decode_us, "conv_varlen_8192_tokens_us": varlen_us}


def chunked_us(lengths: list[int]) -> float:
    num_tokens = sum(lengths)
    q = torch.randn(num_tokens, KEY_HEADS, DIM, device=DEVICE).to(DTYPE)
    k = torch.randn(num_tokens, KEY_HEADS, DIM, device=DEVICE).to(DTYPE)
    v = torch.randn(num_tokens, VALUE_HEADS, DIM, device=DEVICE).to(DTYPE)
    g = -torch.rand(num_tokens, VALUE_HEADS, device=DEVICE)
    beta = torch.rand(num_tokens, VALUE_HEADS, device=DEVICE).to(DTYPE)
    states = torch.zeros(len(lengths) + 1, VALUE_HEADS, DIM, DIM, device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    context_lens = starts[1:] - starts[:-1]
    slots = torch.arange(len(lengths), device=DEVICE)
    return device_us(lambda: chunked_gated_delta_rule(q, k, v, g, beta, states, starts,
                                                      context_lens, slots, DIM ** -0.5),
                     repeats=20)


def chunked_cases() -> dict[str, Any]:
    return {"chunked_one_8192_us": chunked_us([8192]),
            "chunked_eight_1024_us": chunked_us([1024] * 8)}


def mixed_step_case() -> dict[str, Any]:
    num_decodes, chunk_len, num_seqs, num_tokens = 63, 1024, 257, 1088
    # decode rows, the chunk (continuing its slot), the padding sequence, empty padding
    lengths = [1] * num_decodes + [chunk_len, num_tokens - num_decodes - chunk_len]
    lengths += [0] * (num_seqs - len(lengths))
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    context_lens = torch.tensor([500] * num_decodes + [2 * chunk_len]
                                + [0] * (num_seqs - num_decodes - 1), device=DEVICE)
    slots = torch.tensor([*range(num_decodes + 1)] + [-1] * (num_seqs - num_decodes - 1),
                         device=DEVICE)
    q = torch.randn(num_tokens, KEY_HEADS, DIM, device=DEVICE).to(DTYPE)
    k = torch.randn(num_tokens, KEY_HEADS, DIM, device=DEVICE).to(DTYPE)
    v = torch.randn(num_tokens, VALUE_HEADS, DIM, device=DEVICE).to(DTYPE)
    a = torch.randn(num_tokens, VALUE_HEADS, device=DEVICE).to(DTYPE)
    b = torch.randn(num_tokens, VALUE_HEADS, device=DEVICE).to(DTYPE)
    a_log = torch.randn(VALUE_HEADS, device=DEVICE)
    dt_bias = torch.randn(VALUE_HEADS, device=DEVICE)
    states = torch.randn(num_decodes + 8, VALUE_HEADS, DIM, DIM, device=DEVICE) * 0.05
    before_states, after_states = states.clone(), states.clone()
    scale = DIM ** -0.5

    def before() -> torch.Tensor:
        g, beta = kernels.gdn_gates(a, b, a_log, dt_bias)
        return chunked_gated_delta_rule(q, k, v, g, beta, before_states, starts, context_lens,
                                        slots, scale)

    def after() -> torch.Tensor:
        return mixed_gated_delta_rule(q, k, v, a, b, a_log, dt_bias, after_states, starts,
                                      context_lens, slots, scale, MAX_CHUNKED_SEQS)

    real = slice(0, num_decodes + chunk_len)
    difference = (before()[real].float() - after()[real].float()).abs().max().item()
    state_difference = (before_states - after_states).abs().max().item()
    return {"mixed_step_every_slot_through_fla_us": device_us(before, repeats=20),
            "mixed_step_compacted_us": device_us(after, repeats=20),
            "mixed_step_max_output_difference": difference,
            "mixed_step_max_state_difference": state_difference}


def main() -> None:
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                               "decode": [decode_case(batch) for batch in (1, 64, 256)]}
    results.update(conv_cases())
    results.update(chunked_cases())
    results.update(mixed_step_case())
    print(json.dumps(results, indent=1), flush=True)
    (OUT / "hybrid-kernels.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
