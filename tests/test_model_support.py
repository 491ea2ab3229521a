"""Tiny random checkpoints built by transformers' own classes, and the comparison of
our greedy generation with its ``generate``, for the model tests (no tests here).

The weights are drawn from seeded generators with spreads that keep the logits well
apart, so greedy choices are never near-ties: every test that builds the same model
gets the same bits.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trio_llm.actors.config import EngineConfig
from trio_llm.gpu.attention import get_attention_backend
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.testing import DriverRequest, ExecutorDriver, record_logits

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 384
NUM_NEW_TOKENS = 6
PROMPT_LENGTHS = [5, 23, 41, 1]
# Prefill chunk plans per prompt: odd boundaries, including single-token chunks.
CHUNK_PLANS = [[2, 3], [7, 1, 5], [13, 11], [4]]
ARRIVAL_STEPS = [0, 0, 2, 3]

HYBRID_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM",
                        "Qwen3_5ForConditionalGeneration",
                        "Qwen3_5MoeForConditionalGeneration")
# layers 0-2 linear attention, 3 full attention, 4 linear (as full_attention_interval 4)
HYBRID_TEXT = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=5,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, max_position_embeddings=256, eos_token_id=None,
                   bos_token_id=None, pad_token_id=0)
# the shared expert as wide as a routed one, as Qwen3.5-MoE and Qwen3-Next publish it:
# stacked as one more expert (gpu/layers/moe.py); Qwen2-MoE's below is wider (its own layers)
HYBRID_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              patch_size=4, temporal_patch_size=2, spatial_merge_size=2)


def dense_config(family: str):
    """A tiny config of ``family`` (llama with llama3 RoPE scaling, qwen2, qwen3)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
                  pad_token_id=0)
    if family == "llama":
        return transformers.LlamaConfig(
            **common, rope_theta=500000.0, attention_bias=True,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    return transformers.Qwen3Config(**common, head_dim=32)


def moe_config(family: str):
    """A tiny config of ``family``: 8 (Qwen3) or 4 experts, top-2, hidden and head sizes
    the fused CPU kernels take (multiples of 16)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
                  bos_token_id=None, pad_token_id=0, num_experts_per_tok=2)
    if family == "qwen3_moe":
        # layer 1 dense (mlp_only_layers), the experts' top-2 renormalised
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_hidden_layers=3,
                                           intermediate_size=96, moe_intermediate_size=32,
                                           num_experts=8, norm_topk_prob=True,
                                           mlp_only_layers=[1])
    if family in ("qwen2_moe", "qwen2_moe_stacked"):
        # a shared expert wider than a routed one has layers of its own; one as wide is
        # stacked as one more expert (gpu/layers/moe.py)
        shared = 32 if family == "qwen2_moe_stacked" else 48
        return transformers.Qwen2MoeConfig(**common, num_hidden_layers=2,
                                           intermediate_size=96, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=shared,
                                           num_experts=4)
    return transformers.MixtralConfig(**common, head_dim=16, num_hidden_layers=2,
                                      intermediate_size=32, num_local_experts=4)


def hybrid_model(architecture: str):
    """A tiny model of ``architecture``, one of HYBRID_ARCHITECTURES, built by transformers
    (the ConditionalGeneration ones with a tiny vision tower)."""
    if architecture == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**HYBRID_TEXT, intermediate_size=96))
    if architecture == "Qwen3_5MoeForCausalLM":
        return transformers.Qwen3_5MoeForCausalLM(
            transformers.Qwen3_5MoeTextConfig(**HYBRID_TEXT, **HYBRID_EXPERTS))
    if architecture == "Qwen3NextForCausalLM":
        # layer 1 a dense MLP (mlp_only_layers), the others experts, top-k renormalised
        return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **HYBRID_TEXT, **HYBRID_EXPERTS, intermediate_size=96, mlp_only_layers=[1],
            norm_topk_prob=True))
    if architecture == "Qwen3_5ForConditionalGeneration":
        return transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(
            text_config={**HYBRID_TEXT, "intermediate_size": 96}, vision_config=VISION))
    return transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
        text_config={**HYBRID_TEXT, **HYBRID_EXPERTS}, vision_config=VISION))


def randomise(model: Any, seed: int) -> None:
    """Weights with well-spread logits (dense and MoE families: norms near one), and
    router logits spread enough that the experts' choice changes from token to token."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                parameter.copy_(0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                parameter.copy_(0.6 * noise)
            else:
                parameter.copy_(noise * parameter.shape[-1] ** -0.5)


def randomise_hybrid(model: Any, seed: int) -> None:
    """Weights with well-spread logits for the hybrid family: the ``(1 + weight)`` norms'
    offsets from one (the gated norm's weight itself near one) and the decay
    parameters random too; biases (the vision tower's) drawn as weights are."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(0.1 * noise + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                parameter.copy_(0.5 * noise)
            elif "embed" in name or "lm_head" in name:
                parameter.copy_(0.6 * noise)
            else:
                parameter.copy_(noise * parameter.shape[-1] ** -0.5)


def random_causal_lm(config: Any, seed: int) -> Any:
    """transformers' model of ``config`` (a dense or MoE family's), randomised, in eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomise(model, seed=seed)
    return model.eval()


def random_hybrid_model(architecture: str) -> Any:
    """``hybrid_model(architecture)`` randomised (seeded by the name), in eval mode."""
    torch.manual_seed(0)
    model = hybrid_model(architecture)
    randomise_hybrid(model, seed=len(architecture))
    return model.eval()


def saved(model: Any, directory: Path) -> tuple[Path, Any]:
    """``(directory, model)``, ``model`` written to ``directory`` by ``save_pretrained``."""
    model.save_pretrained(directory)
    return directory, model


def random_prompts() -> list[list[int]]:
    """One prompt of each of PROMPT_LENGTHS, of random token ids."""
    rng = random.Random(1)
    return [[rng.randrange(VOCAB_SIZE) for _ in range(length)] for length in PROMPT_LENGTHS]


def reference(model: Any, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits each was chosen from."""
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                min_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                return_dict_in_generate=True, output_logits=True,
                                pad_token_id=0)
    tokens = output.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat(output.logits)


def run_executor(directory, prompts, *, block_size, device="cpu", attention_backend=None):
    """The prompts through ModelExecutor, arriving at ARRIVAL_STEPS, prefilled in
    CHUNK_PLANS, each decoding NUM_NEW_TOKENS from the previous step's token: the
    requests, and the logits each token was sampled from."""
    executor = ModelExecutor.create(EngineConfig(model=str(directory), block_size=block_size,
                                                 num_kv_blocks=512, device=device,
                                                 dtype="float32"))
    if attention_backend is not None:
        executor.model.attention_backend = get_attention_backend(attention_backend)
    recorded = record_logits(executor)
    requests = [DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                              max_tokens=NUM_NEW_TOKENS, chunk_sizes=CHUNK_PLANS[index],
                              arrival_step=ARRIVAL_STEPS[index])
                for index, prompt in enumerate(prompts)]
    ExecutorDriver(executor, decode_input="previous_step").run(requests)
    return requests, recorded


def assert_generates_as_transformers(model: Any, prompts, requests, recorded, *,
                                     atol: float) -> None:
    """Each request's tokens are transformers' greedy tokens for its prompt, its logits
    within ``atol`` of those they were chosen from."""
    for request, prompt in zip(requests, prompts, strict=True):
        expected_tokens, expected_logits = reference(model, prompt)
        assert request.output_token_ids == expected_tokens
        ours = torch.stack([recorded[(request.request_id, index)].cpu()
                            for index in range(NUM_NEW_TOKENS)])
        torch.testing.assert_close(ours, expected_logits, rtol=0, atol=atol)


def assert_same_bits_alone_or_batched(recorded_logits: Callable[[list[DriverRequest]], dict],
                                      prompts) -> None:
    """Each request alone, in one chunk; then all of them in one run, arriving at
    different steps, prefilled in odd chunks, one preempted and recomputed: every logit
    the same bits. ``recorded_logits`` runs requests and returns their logits."""
    alone: dict = {}
    for index, prompt in enumerate(prompts):
        alone |= recorded_logits([DriverRequest(
            request_id=f"r{index}", prompt_token_ids=prompt, max_tokens=NUM_NEW_TOKENS)])
    batched = recorded_logits([
        DriverRequest(request_id=f"r{index}", prompt_token_ids=prompt,
                      max_tokens=NUM_NEW_TOKENS, chunk_sizes=[3, 7, 1 << 30],
                      arrival_step=index % 2, preempt_at_steps=[4] if index == 1 else [])
        for index, prompt in enumerate(prompts)])
    assert alone.keys() == batched.keys()
    for key, logits in alone.items():
        assert torch.equal(batched[key], logits), key
