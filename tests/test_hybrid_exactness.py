"""The hybrid family through the whole engine on the CPU: tiny random checkpoints
written by transformers' own classes (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM).
Greedy tokens are the same alone or batched, at depth 1 or 2, preempted or not,
with prefix caching on (state snapshots, hits counted) or off, and the state slots
are all free again at the end."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import trio
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine
from trio_llm.gpu.builtin import resolve_model

transformers = pytest.importorskip("transformers")

VOCAB_SIZE = 384
TIMEOUT = 300
# layers 0-2 linear attention, 3 full attention (full_attention_interval 4)
TEXT = dict(vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, max_position_embeddings=512, eos_token_id=None,
            bos_token_id=None, pad_token_id=0)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)


def tiny_model(architecture: str):
    if architecture == "Qwen3_5ForCausalLM":
        return transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**TEXT, intermediate_size=96))
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT, **EXPERTS))


@pytest.fixture(scope="module", params=["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def checkpoint(request, tmp_path_factory):
    """A random checkpoint (well-spread logits: greedy choices are no near-ties), with
    the built-in tiny model's tokenizer beside it."""
    directory = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model = tiny_model(request.param)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            if "norm" in name:
                parameter.copy_(0.1 * noise + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                parameter.copy_(noise * parameter.shape[-1] ** -0.5)
    model.save_pretrained(directory)
    tokenizer_directory = resolve_model("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_directory / name, directory / name)
    return directory


def shared_prefix_workload() -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): prompts that share one of two prefixes then diverge,
    and repeats of earlier prompts (vLLM's prefix_repetition, and multi-turn)."""
    rng = random.Random(17)
    prefixes = [[rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in (37, 22)]
    workload: list[tuple[list[int], int]] = []
    for index in range(10):
        if index % 4 == 3:
            prompt = workload[rng.randrange(index)][0]
        else:
            prompt = rng.choice([[], *prefixes]) + [rng.randrange(3, VOCAB_SIZE)
                                                    for _ in range(rng.randint(1, 12))]
        workload.append((prompt, rng.randint(1, 8)))
    return workload


async def collect(engine: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    token_ids: list[int] = []
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for output in engine.generate(prompt, params):
        token_ids += output.token_ids
    return token_ids


def assert_all_free(engine: Engine) -> None:
    statistics = engine.statistics()
    assert statistics.num_running == 0
    assert statistics.num_free_blocks == statistics.num_total_blocks
    assert (statistics.num_free_state_slots + statistics.num_state_snapshots
            == statistics.num_total_state_slots > 0), "a state slot leaked"


async def run_together(config: EngineConfig, workload) -> tuple[list[list[int]], object]:
    results: list[list[int]] = [[] for _ in workload]
    async with Engine.open(config) as engine:

        async def one(index: int) -> None:
            results[index] = await collect(engine, *workload[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(workload)):
                nursery.start_soon(one, index)
        assert_all_free(engine)
        return results, engine.statistics()


async def test_greedy_tokens_are_the_same_under_every_schedule(checkpoint) -> None:
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32",
                          num_kv_blocks=256, block_size=4, max_num_seqs=8,
                          max_num_batched_tokens=48, max_state_snapshots=8)
    workload = shared_prefix_workload()
    with trio.fail_after(TIMEOUT):
        async with Engine.open(replace(config, pipeline_depth=1,
                                       enable_prefix_caching=False)) as engine:
            reference = [await collect(engine, *item) for item in workload]
            assert_all_free(engine)
        variants = {
            "together, caching on, depth 2": config,
            "together, caching on, depth 1": replace(config, pipeline_depth=1),
            "together, caching off": replace(config, enable_prefix_caching=False),
            "together, preempted": replace(config, num_kv_blocks=24),
        }
        for name, variant in variants.items():
            results, statistics = await run_together(variant, workload)
            assert results == reference, name
            if name == "together, preempted":
                assert statistics.num_preemptions > 0, name  # type: ignore[attr-defined]
        async with Engine.open(config) as engine:  # one at a time: every repeat can hit
            alone_cached = [await collect(engine, *item) for item in workload]
            assert engine.statistics().num_prefix_cache_hits > 0
            assert_all_free(engine)
    assert alone_cached == reference
