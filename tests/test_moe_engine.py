"""A Mixture-of-Experts model through the whole engine on the CPU (built-in ``tiny-moe``,
Qwen3-MoE layers: 8 experts, top 2): transformers' tokens; the same tokens alone or
batched, at depth 1 or 2, preempted or not, with prefix caching on or off, over two
API servers or in-process; and served over HTTP end to end."""

from __future__ import annotations

import httpx
import pytest
import torch
import trio
from msgspec.structs import replace
from test_engine_exactness import make_workload, run_alone, run_together
from test_http_support import running_server
from test_prefix_caching import shared_prefix_workload
from test_served_layout import PROMPTS, SAMPLINGS, collect

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.tokenizer import Tokenizer
from trio_llm.api.engine import Engine
from trio_llm.api.processes import open_served_layout
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.layers.moe import SparseMoeBlock
from trio_llm.gpu.testing import DriverRequest, ExecutorDriver

NUM_REQUESTS = 12
TIMEOUT = 300
AMPLE = EngineConfig(model="tiny-moe", num_kv_blocks=512, block_size=16, max_num_seqs=64,
                     max_num_batched_tokens=256)
# 40 blocks of 4 tokens: far less than the requests need at once
TIGHT = EngineConfig(model="tiny-moe", num_kv_blocks=40, block_size=4, max_num_seqs=32,
                     max_num_batched_tokens=64)


def test_tiny_moe_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    directory = resolve_model("tiny-moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt = Tokenizer.from_dir(directory).encode("The cat sat by the fire and")
    executor = ModelExecutor.create(EngineConfig(model="tiny-moe", num_kv_blocks=64,
                                                 device="cpu", dtype="float32"))
    assert any(isinstance(module, SparseMoeBlock) for module in executor.model.modules())
    request = DriverRequest(request_id="moe", prompt_token_ids=prompt, max_tokens=12,
                            chunk_sizes=[5, 3])
    ExecutorDriver(executor).run([request])
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                                  do_sample=False, pad_token_id=0)
    assert request.output_token_ids == expected[0, len(prompt):].tolist()
    assert len(set(request.output_token_ids)) > 3  # not one token repeated


async def test_same_tokens_under_every_batching() -> None:
    workload = make_workload(sampled=False)[:NUM_REQUESTS]
    with trio.fail_after(TIMEOUT):
        reference = await run_alone(replace(AMPLE, pipeline_depth=1), workload)
        assert all(reference)
        variants = {"together, depth 2": AMPLE,
                    "together, depth 1": replace(AMPLE, pipeline_depth=1),
                    "together, small chunks": replace(AMPLE, max_num_batched_tokens=37)}
        for name, config in variants.items():
            results, _ = await run_together(config, workload)
            assert results == reference, name
        for depth in (2, 1):
            results, num_preemptions = await run_together(replace(TIGHT, pipeline_depth=depth),
                                                          workload)
            assert num_preemptions > 0, "the small KV cache forced preemption"
            assert results == reference, f"preempted, depth {depth}"


async def test_prefix_caching_on_gives_the_tokens_of_caching_off() -> None:
    workload = shared_prefix_workload(sampled=False, num_requests=NUM_REQUESTS)
    with trio.fail_after(TIMEOUT):
        async with Engine.open(replace(AMPLE, enable_prefix_caching=False)) as engine:
            reference = [await collect(engine, prompt, params) for prompt, params in workload]
        async with Engine.open(AMPLE) as engine:
            cached = [await collect(engine, prompt, params) for prompt, params in workload]
            assert engine.statistics().num_prefix_cache_hits > 0
    assert cached == reference


async def test_outputs_over_two_api_servers_equal_the_in_process_ones() -> None:
    config = replace(AMPLE, num_kv_blocks=128)
    requests = [(prompt, SAMPLINGS[index % 3]) for index, prompt in enumerate(PROMPTS)]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:
            expected = [await collect(engine, prompt, params) for prompt, params in requests]
        results: dict[int, list[int]] = {}
        async with open_served_layout(config, 2) as fronts:
            async with trio.open_nursery() as nursery:
                for index, (prompt, params) in enumerate(requests):
                    async def run(index: int = index, prompt: list[int] = prompt,
                                  params: object = params) -> None:
                        results[index] = await collect(fronts[index % 2], prompt,
                                                       params)  # type: ignore[arg-type]

                    nursery.start_soon(run)
    assert [results[index] for index in range(len(requests))] == expected


async def test_an_moe_model_served_over_http() -> None:
    """A chat completion and a streamed completion from the MoE model: the greedy text
    the engine gives in-process."""
    config = replace(AMPLE, num_kv_blocks=128)
    prompt = "Once upon a time"
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:
            expected = [token_id async for output in engine.generate(
                prompt, replace(SAMPLINGS[0], max_tokens=8)) for token_id in output.token_ids]
            async with running_server(engine) as url, httpx.AsyncClient(timeout=60) as client:
                response = await client.post(f"{url}/v1/completions", json={
                    "model": "tiny-moe", "prompt": prompt, "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                chat = await client.post(f"{url}/v1/chat/completions", json={
                    "model": "tiny-moe", "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == expected
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
