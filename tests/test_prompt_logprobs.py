"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``):
the logprob of each prompt token at the position before it, the same however the
prompt is chunked, batched, preempted or pipelined, from either executor, and over
HTTP in the legacy completions shape with the first token's logprob null."""

from __future__ import annotations

import msgspec
import openai
import pytest
import torch
import trio
import trio.lowlevel
from test_executor_support import HeldFirstStep

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import (
    NewRequestData,
    RequestOutput,
    SamplingOptions,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
)
from trio_llm.api.engine import Engine
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.testing import run_depth_1, run_depth_2

CONFIG = EngineConfig(model="tiny", num_kv_blocks=128, block_size=4, max_num_seqs=8,
                      max_num_batched_tokens=64)
PROMPTS = [[20 + (index * 11 + offset * 3) % 60 for offset in range(5 + index * 9)]
           for index in range(4)]


async def run(engine: Engine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    first = None
    async for output in engine.generate(prompt, params):
        first = first or output
    assert first is not None
    return first


def asked(num_alternatives: int = 2, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=num_alternatives)


async def reference_logprobs(engine: Engine, prompt: list[int]) -> list[float]:
    """Each prompt token's logprob through another path: the prompt cut before it,
    sampling only that token (allowed_token_ids) and reporting its raw logprob."""
    values = []
    for index in range(1, len(prompt)):
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                                allowed_token_ids=[prompt[index]])
        output = await run(engine, prompt[:index], params)
        assert output.token_ids == [prompt[index]] and output.logprobs is not None
        entry = output.logprobs[0]
        assert entry is not None
        values.append(entry.logprob)
    return values


async def test_prompt_logprobs_are_each_tokens_logprob_at_the_position_before() -> None:
    with trio.fail_after(120):
        async with Engine.open(CONFIG) as engine:
            prompt = PROMPTS[2]
            output = await run(engine, prompt, asked(3))
            expected = await reference_logprobs(engine, prompt)
    assert output.prompt_token_ids == prompt
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    entries = output.prompt_logprobs[1:]
    assert all(entry is not None for entry in entries)
    assert [entry.logprob for entry in entries] == pytest.approx(expected, abs=1e-5)
    for entry in entries:
        assert len(entry.top_token_ids) == 3 and entry.top_logprobs == sorted(
            entry.top_logprobs, reverse=True)
        assert entry.logprob <= entry.top_logprobs[0] + 1e-6


async def collect_all(config: EngineConfig, *, together: bool, min_preemptions: int = 0
                      ) -> list[tuple[list[int], list[float | None]]]:
    """Each prompt's tokens and prompt logprobs: one after another, or ``together``
    (all four queued in order while the first step is held, then batched)."""
    results: list[tuple[list[int], list[float | None]]] = [([], [])] * len(PROMPTS)
    inner = await trio.to_thread.run_sync(ModelExecutor.create, config)
    executor = HeldFirstStep(inner)
    async with Engine.open(config, executor=executor) as engine:

        def keep(index: int, token_ids: list[int], first: RequestOutput | None) -> None:
            assert first is not None and first.prompt_logprobs is not None
            results[index] = (token_ids, [None if entry is None else entry.logprob
                                          for entry in first.prompt_logprobs])

        async def one(index: int) -> None:
            token_ids, first = [], None
            async for output in engine.generate(PROMPTS[index], asked(max_tokens=16)):
                first = first or output
                token_ids += output.token_ids
            keep(index, token_ids, first)

        async def all_four() -> None:
            token_ids: list[list[int]] = [[] for _ in PROMPTS]
            firsts: list[RequestOutput | None] = [None] * len(PROMPTS)
            async for index, output in engine.generate_many(
                    [(prompt, asked(max_tokens=16)) for prompt in PROMPTS]):
                firsts[index] = firsts[index] or output
                token_ids[index] += output.token_ids
            for index, first in enumerate(firsts):
                keep(index, token_ids[index], first)

        if together:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(all_four)
                # no event to wait on: intake's worker thread admits them one by one
                while num_admitted(engine) < len(PROMPTS):  # noqa: ASYNC110
                    await trio.lowlevel.checkpoint()
                executor.release()
        else:
            executor.release()
            for index in range(len(PROMPTS)):
                await one(index)
        stats = engine.statistics()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_preemptions >= min_preemptions
    return results


def num_admitted(engine: Engine) -> int:
    """Requests the scheduler runs (the held first step's) and those queued."""
    stats = engine.statistics()
    return stats.num_running + stats.num_waiting


async def test_the_same_prompt_logprobs_chunked_batched_preempted_and_cached() -> None:
    with trio.fail_after(300):
        reference = await collect_all(msgspec.structs.replace(CONFIG, pipeline_depth=1),
                                      together=False)
        for config, min_preemptions in (
                (CONFIG, 0),  # depth 2, batched
                (msgspec.structs.replace(CONFIG, max_num_batched_tokens=8), 0),  # chunked
                (msgspec.structs.replace(CONFIG, num_kv_blocks=13), 1),  # preempted
                (msgspec.structs.replace(CONFIG, enable_prefix_caching=False), 0)):
            assert await collect_all(config, together=True,
                                     min_preemptions=min_preemptions) == reference
    assert [len(logprobs) for _, logprobs in reference] == [len(p) for p in PROMPTS]


async def test_a_request_with_prompt_logprobs_computes_its_whole_prompt() -> None:
    """It never starts from cached blocks (their positions' logits were never kept);
    a request after it may start from its blocks."""
    with trio.fail_after(120):
        async with Engine.open(CONFIG) as engine:
            prompt = PROMPTS[3]
            await run(engine, prompt, SamplingParams(max_tokens=1))
            before = engine.statistics()
            output = await run(engine, prompt, asked())
            after = engine.statistics()
    assert after.num_prefix_cache_hits == before.num_prefix_cache_hits
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)


def chunked_batches(vocab_size: int) -> list[ScheduledBatch]:
    """A prompt of 10 in chunks of 4, 4 and 2 beside a plain request, then a decode."""
    greedy = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                             num_logprobs=None, min_tokens=0, banned_token_ids=[],
                             num_prompt_logprobs=2)
    prompt = [(7 * index + 3) % vocab_size for index in range(10)]
    new = [NewRequestData(request_id="p", sampling=greedy),
           NewRequestData(request_id="q", sampling=msgspec.structs.replace(
               greedy, num_prompt_logprobs=None))]

    def chunk(start: int, end: int, blocks: list[int]) -> ScheduledRequest:
        return ScheduledRequest(request_id="p", token_ids=prompt[start:end],
                                input_from_previous_step=False, num_computed_tokens=start,
                                new_block_ids=blocks, sample=end == 10, output_index=0,
                                prompt_logprob_token_ids=prompt[start + 1:min(end, 9) + 1])

    def plain(computed: int, token_ids: list[int] | None, blocks: list[int]) -> ScheduledRequest:
        return ScheduledRequest(request_id="q", token_ids=token_ids or [],
                                input_from_previous_step=token_ids is None,
                                num_computed_tokens=computed, new_block_ids=blocks, sample=True,
                                output_index=computed - 2 if computed else 0)

    def batch(step_id: int, requests: list[ScheduledRequest]) -> ScheduledBatch:
        return ScheduledBatch(step_id=step_id, new_requests=new if step_id == 0 else [],
                              requests=requests, finished_request_ids=[],
                              num_tokens=sum(len(r.token_ids) or 1 for r in requests))

    return [batch(0, [chunk(0, 4, [0]), plain(0, [5, 6, 7], [8])]),
            batch(1, [chunk(4, 8, [1]), plain(3, None, [])]),
            batch(2, [chunk(8, 10, [2]), plain(4, None, [9])])]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA device")])])
def test_the_pipelined_executor_reports_the_plain_executors_prompt_logprobs(device) -> None:
    path = resolve_model("tiny")
    torch_device = torch.device(device)

    def build(executor_class):
        model = load_model(path, dtype=torch.float32, device=torch_device)
        return executor_class(model, model_path=path, num_kv_blocks=16, block_size=4,
                              max_model_len=64)

    def pipelined() -> CudaModelExecutor:
        executor = build(CudaModelExecutor)
        executor.start(CudaExecutorOptions(max_num_seqs=4, use_cuda_graphs=device == "cuda",
                                           use_fused_kernels=device == "cuda"))
        return executor

    plain = build(ModelExecutor)
    batches = chunked_batches(plain.vocab_size)
    # on CUDA fused layers change the logits' low bits: the plain executor agrees to
    # rounding, and the pipelined one at depth 2 with itself at depth 1 exactly
    approximate = [plain.execute(batch) for batch in batches]
    expected = approximate if device == "cpu" else run_depth_1(pipelined(), batches)
    results = run_depth_2(pipelined(), batches)
    assert [len(chunk.logprobs) for r in expected for chunk in r.prompt_logprobs] == [4, 4, 1]
    for ours, theirs in zip(results, approximate, strict=True):
        for mine, reference in zip(ours.prompt_logprobs, theirs.prompt_logprobs, strict=True):
            assert [e.logprob for e in mine.logprobs] == pytest.approx(
                [e.logprob for e in reference.logprobs], abs=1e-3)
    for ours, theirs in zip(results, expected, strict=True):
        assert ours.sampled_token_ids == theirs.sampled_token_ids
        assert [c.request_id for c in ours.prompt_logprobs] == [
            c.request_id for c in theirs.prompt_logprobs]
        for mine, reference in zip(ours.prompt_logprobs, theirs.prompt_logprobs, strict=True):
            assert [e.logprob for e in mine.logprobs] == pytest.approx(
                [e.logprob for e in reference.logprobs], abs=1e-4)
            assert [e.top_token_ids for e in mine.logprobs] == [
                e.top_token_ids for e in reference.logprobs]


async def test_echo_with_logprobs_over_http() -> None:
    from test_http_support import running_server

    with trio.fail_after(120):
        async with Engine.open(CONFIG) as engine, running_server(engine) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            try:
                response = await client.completions.create(
                    model="tiny", prompt=PROMPTS[1], max_tokens=3, temperature=0.0, echo=True,
                    logprobs=2, extra_body={"ignore_eos": True})
            finally:
                await client.close()
            direct = await run(engine, PROMPTS[1], SamplingParams(
                max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2))
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    num_prompt_tokens = len(PROMPTS[1])
    assert len(logprobs.token_logprobs) == num_prompt_tokens + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert direct.prompt_logprobs is not None
    assert logprobs.token_logprobs[1:num_prompt_tokens] == pytest.approx(
        [entry.logprob for entry in direct.prompt_logprobs[1:]], abs=1e-6)
    assert all(value is not None for value in logprobs.token_logprobs[num_prompt_tokens:])
    assert logprobs.text_offset[0] == 0
    assert response.choices[0].text.startswith("".join(logprobs.tokens[:num_prompt_tokens]))
