"""Automatic prefix caching through the whole engine, on the tiny model (CPU).

Exactness: requests that share system prompts give the same tokens with
caching on as with caching off, greedy and seeded, alone and batched, depth 1
and 2, with a KV cache so small that requests are preempted and recomputed
(from their own cached blocks). Then hits across requests, eviction under
pressure, cache salts, the metrics over HTTP, and the executors running a
request whose first chunk starts after cached tokens.
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch
import trio
from msgspec.structs import replace

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import (
    NewRequestData,
    SamplingOptions,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
)
from trio_llm.api.engine import Engine
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.testing import run_depth_1, run_depth_2

VOCAB_LIMIT = 1000  # the tiny model's vocabulary is larger; stay clear of special ids
BLOCK_SIZE = 16
# The CPU path, where caching on and off must give the same tokens (see GPU below).
AMPLE = EngineConfig(model="tiny", device="cpu", num_kv_blocks=256, block_size=BLOCK_SIZE,
                     max_num_seqs=64, max_num_batched_tokens=256)
# 40 blocks of 4 tokens: far less than the requests need at once.
TIGHT = EngineConfig(model="tiny", device="cpu", num_kv_blocks=40, block_size=4,
                     max_num_seqs=24, max_num_batched_tokens=64)

Workload = list[tuple[list[int], SamplingParams]]


def shared_prefix_workload(*, sampled: bool, num_requests: int = 24) -> Workload:
    """Prompts that start with one of three system prompts (or none), then their own
    tokens; every fourth request repeats an earlier prompt exactly."""
    rng = random.Random(99 if sampled else 98)
    prefixes = [[rng.randrange(3, VOCAB_LIMIT) for _ in range(length)] for length in (40, 70, 33)]
    workload: Workload = []
    for index in range(num_requests):
        if index % 4 == 3:
            prompt = workload[rng.randrange(index)][0]
        else:
            prefix = rng.choice([[], *prefixes])
            prompt = prefix + [rng.randrange(3, VOCAB_LIMIT) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, 30),
                                temperature=0.8 if sampled else 0.0,
                                top_p=0.9 if sampled and index % 2 else 1.0,
                                seed=index if sampled else None, ignore_eos=True)
        workload.append((prompt, params))
    return workload


async def collect(engine: Engine, prompt: list[int], params: SamplingParams, *,
                  cache_salt: str | None = None) -> list[int]:
    token_ids: list[int] = []
    async for output in engine.generate(prompt, params, cache_salt=cache_salt):
        token_ids += output.token_ids
    return token_ids


async def run_alone(config: EngineConfig, workload: Workload) -> list[list[int]]:
    async with Engine.open(config) as engine:
        return [await collect(engine, *item) for item in workload]


async def run_together(config: EngineConfig, workload: Workload) -> tuple[list[list[int]], Engine]:
    results: list[list[int]] = [[] for _ in workload]
    async with Engine.open(config) as engine:

        async def one(index: int) -> None:
            results[index] = await collect(engine, *workload[index])

        async with trio.open_nursery() as nursery:
            for index in range(len(workload)):
                nursery.start_soon(one, index)
        statistics = engine.statistics()
        assert statistics.num_free_blocks == statistics.num_total_blocks
    return results, engine


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
async def test_caching_on_gives_the_tokens_of_caching_off(sampled: bool) -> None:
    workload = shared_prefix_workload(sampled=sampled)
    with trio.fail_after(300):
        reference = await run_alone(
            replace(AMPLE, enable_prefix_caching=False, pipeline_depth=1), workload)
        assert all(reference)
        assert await run_alone(AMPLE, workload) == reference, "alone, caching on"

        variants = {"together, depth 2": AMPLE,
                    "together, depth 1": replace(AMPLE, pipeline_depth=1),
                    "preempted, depth 2": TIGHT,
                    "preempted, depth 1": replace(TIGHT, pipeline_depth=1)}
        if sampled:  # the seeded run checks the two that differ most
            del variants["together, depth 1"], variants["preempted, depth 1"]
        for name, config in variants.items():
            results, engine = await run_together(config, workload)
            statistics = engine.statistics()
            assert results == reference, name
            assert statistics.num_prefix_cache_hits > 0, name
            if config.num_kv_blocks == TIGHT.num_kv_blocks:
                assert statistics.num_preemptions > 0, name


async def test_a_shared_prefix_is_computed_once_and_counted_as_hits() -> None:
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB_LIMIT) for _ in range(50)]  # 3 full blocks of 16
    prompts = [system + [rng.randrange(3, VOCAB_LIMIT) for _ in range(5)] for _ in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with trio.fail_after(60):
        async with Engine.open(AMPLE) as engine:
            outputs = [await collect(engine, prompt, params) for prompt in prompts]
            statistics = engine.statistics()
        expected = await run_alone(replace(AMPLE, enable_prefix_caching=False),
                                   [(prompt, params) for prompt in prompts])
    assert outputs == expected
    assert statistics.num_prefix_cache_queries == 4 * 55
    assert statistics.num_prefix_cache_hits == 3 * 48
    assert statistics.num_prompt_tokens == 4 * 55 - 3 * 48  # only the misses were computed


async def test_caching_off_computes_every_prompt_token() -> None:
    prompt = list(range(3, 53))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with trio.fail_after(60):
        async with Engine.open(replace(AMPLE, enable_prefix_caching=False)) as engine:
            for _ in range(3):
                await collect(engine, prompt, params)
            statistics = engine.statistics()
    assert statistics.num_prompt_tokens == 3 * 50
    assert statistics.num_prefix_cache_queries == statistics.num_prefix_cache_hits == 0


async def test_eviction_under_pressure_keeps_outputs_exact() -> None:
    # 12 blocks of 16: a 40-token prompt with 8 outputs computes 47 positions in 3
    # blocks and leaves 2 cached, so the sixth distinct prompt evicts the oldest cached
    # block (the first prompt's second block: a request's later blocks go first).
    config = replace(AMPLE, num_kv_blocks=12)
    rng = random.Random(6)
    prompts = [[rng.randrange(3, VOCAB_LIMIT) for _ in range(40)] for _ in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    order = [0, 1, 2, 3, 4, 5, 0, 5]
    with trio.fail_after(60):
        async with Engine.open(config) as engine:
            hits = []
            outputs = []
            for index in order:
                before = engine.statistics().num_prefix_cache_hits
                outputs.append(await collect(engine, prompts[index], params))
                hits.append(engine.statistics().num_prefix_cache_hits - before)
            block_manager = engine._actors.scheduler.block_manager
            assert block_manager.num_evictions > 0
        expected = await run_alone(replace(config, enable_prefix_caching=False),
                                   [(prompts[index], params) for index in order])
    assert outputs == expected
    assert hits == [0, 0, 0, 0, 0, 0, 16, 32]


async def test_requests_share_blocks_only_within_a_cache_salt() -> None:
    prompt = list(range(3, 40))  # 2 full blocks of 16
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    salts = [None, "tenant-a", "tenant-a", "tenant-b", None]
    with trio.fail_after(60):
        async with Engine.open(AMPLE) as engine:
            hits, outputs = [], []
            for salt in salts:
                before = engine.statistics().num_prefix_cache_hits
                outputs.append(await collect(engine, prompt, params, cache_salt=salt))
                hits.append(engine.statistics().num_prefix_cache_hits - before)
            with pytest.raises(RequestRejected, match="cache_salt"):
                await collect(engine, prompt, params, cache_salt="")
    assert hits == [0, 0, 32, 0, 32]
    assert all(output == outputs[0] for output in outputs)


async def test_metrics_and_cache_salt_over_http() -> None:
    from test_http_support import running_server

    prompt = list(range(3, 40))
    request = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with trio.fail_after(60):
        async with Engine.open(AMPLE) as engine, running_server(engine) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                for salt in (None, "a", "a"):
                    body = request if salt is None else {**request, "cache_salt": salt}
                    response = await client.post("/v1/completions", json=body)
                    assert response.status_code == 200
                empty = await client.post("/v1/completions", json={**request, "cache_salt": ""})
                metrics = (await client.get("/metrics")).text
                chat = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
                    {"role": "user", "content": "a question long enough to fill a block " * 3}]}
                hits = []
                for salt in ("x", "y", "x"):
                    before = engine.statistics().num_prefix_cache_hits
                    response = await client.post("/v1/chat/completions",
                                                 json={**chat, "cache_salt": salt})
                    assert response.status_code == 200
                    hits.append(engine.statistics().num_prefix_cache_hits - before)
            statistics = engine.statistics()
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"
    labels = '{engine="0",model_name="tiny"}'
    assert f"vllm:prefix_cache_queries_total{labels} {3 * 37}.0" in metrics
    assert f"vllm:prefix_cache_hits_total{labels} 32.0" in metrics  # second "a"
    assert hits[:2] == [0, 0] and hits[2] > 0
    assert statistics.num_prefix_cache_hits == 32 + hits[2]


# -- the executors: a request whose first chunk starts after cached tokens ---------------

GREEDY = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                         num_logprobs=None, min_tokens=0, banned_token_ids=[])
EXECUTOR_BLOCK_SIZE = 4


def build_executor(executor_class, device: torch.device, **start_options):
    model = load_model(resolve_model("tiny"), dtype=torch.float32, device=device)
    executor = executor_class(model, model_path=resolve_model("tiny"), num_kv_blocks=32,
                              block_size=EXECUTOR_BLOCK_SIZE, max_model_len=128)
    if start_options:
        from trio_llm.gpu.cuda_executor import CudaExecutorOptions

        executor.start(CudaExecutorOptions(max_num_seqs=4, **start_options))
    return executor


def step(step_id: int, requests: list[ScheduledRequest], *, new: tuple[str, ...] = (),
         finished: tuple[str, ...] = (), sampling: SamplingOptions = GREEDY) -> ScheduledBatch:
    return ScheduledBatch(
        step_id=step_id, new_requests=[NewRequestData(request_id=r, sampling=sampling)
                                       for r in new],
        requests=requests, finished_request_ids=list(finished),
        num_tokens=sum(len(r.token_ids) or 1 for r in requests))


def chunk(request_id: str, token_ids: list[int] | None, computed: int, blocks: list[int],
          output_index: int = 0) -> ScheduledRequest:
    return ScheduledRequest(request_id=request_id, token_ids=token_ids or [],
                            input_from_previous_step=token_ids is None,
                            num_computed_tokens=computed, new_block_ids=blocks, sample=True,
                            output_index=output_index)


PREFIX = [11, 12, 13, 14, 15, 16, 17, 18]  # two full blocks
SUFFIX = [21, 22, 23]


def cached_prefix_batches(sampling: SamplingOptions = GREEDY) -> list[ScheduledBatch]:
    """"a" computes PREFIX + [30] in blocks 0-2 and finishes; "b" starts after the
    two cached blocks 0 and 1 (its first chunk at position 8, in new block 5), and
    "c" starts after them too with a one-token chunk next to b's decode (on CUDA,
    a step for the decode graph)."""
    return [
        step(0, [chunk("a", PREFIX + [30], 0, [0, 1, 2])], new=("a",)),
        step(1, [chunk("b", SUFFIX, 8, [0, 1, 5])], new=("b",), finished=("a",),
             sampling=sampling),
        step(2, [chunk("b", None, 11, [], 1), chunk("c", [40], 8, [0, 1, 6])], new=("c",),
             sampling=sampling),
        step(3, [chunk("b", None, 12, [7], 2), chunk("c", None, 9, [], 1)]),
    ]


def uncached_batches(sampling: SamplingOptions = GREEDY) -> list[ScheduledBatch]:
    """The same requests "b" and "c", each computing PREFIX itself."""
    return [
        step(0, [chunk("b", PREFIX + SUFFIX, 0, [8, 9, 10])], new=("b",), sampling=sampling),
        step(1, [chunk("b", None, 11, [], 1), chunk("c", PREFIX + [40], 0, [11, 12, 13])],
             new=("c",), sampling=sampling),
        step(2, [chunk("b", None, 12, [14], 2), chunk("c", None, 9, [], 1)]),
    ]


def sampled_tokens(results) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for result in results:
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids,
                                        strict=True):
            tokens.setdefault(request_id, []).append(token_id)
    return tokens


def first_logprobs(results) -> dict[str, list[float]]:
    """Each request's top logprobs at its first sampled token (inputs equal in both runs)."""
    first: dict[str, list[float]] = {}
    for result in results:
        for request_id, entry in zip(result.request_ids, result.logprobs or [], strict=False):
            if entry is not None:
                first.setdefault(request_id, entry.top_logprobs)
    return first


def run_steps(executor, batches) -> dict[str, list[int]]:
    return sampled_tokens(run_depth_1(executor, batches))


def run_steps_depth_2(executor, batches) -> dict[str, list[int]]:
    return sampled_tokens(run_depth_2(executor, batches))


def test_the_cpu_executor_continues_exactly_after_a_cached_prefix() -> None:
    cpu = torch.device("cpu")
    cached = run_steps(build_executor(ModelExecutor, cpu), cached_prefix_batches())
    uncached = run_steps(build_executor(ModelExecutor, cpu), uncached_batches())
    assert cached["b"] == uncached["b"] and cached["c"] == uncached["c"]
    assert len(cached["b"]) == 3


def test_the_pipelined_executor_on_the_cpu_continues_after_a_cached_prefix() -> None:
    from trio_llm.gpu.cuda_executor import CudaModelExecutor

    cpu = torch.device("cpu")
    expected = run_steps(build_executor(ModelExecutor, cpu), uncached_batches())
    pipelined = build_executor(CudaModelExecutor, cpu, use_cuda_graphs=False,
                               use_fused_kernels=False)
    cached = run_steps_depth_2(pipelined, cached_prefix_batches())
    assert cached["b"] == expected["b"] and cached["c"] == expected["c"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fast", [False, True], ids=["eager", "graphs-fused"])
def test_gpu_executor_continues_after_a_cached_prefix(fast: bool) -> None:
    """On CUDA the cached prefix's KV came from another request's prefill (GEMMs of
    another shape), so its low bits may differ from a recompute: the first sampled
    token's top logprobs must agree to within float noise (a wrong offset, slot or
    block would be far off), and the token match is printed."""
    from trio_llm.gpu.cuda_executor import CudaModelExecutor

    cuda = torch.device("cuda")
    sampling = replace(GREEDY, num_logprobs=5)
    start_options = {"use_cuda_graphs": fast, "use_fused_kernels": fast}
    uncached = run_depth_1(build_executor(CudaModelExecutor, cuda, **start_options),
                           uncached_batches(sampling))
    cached = run_depth_2(build_executor(CudaModelExecutor, cuda, **start_options),
                                 cached_prefix_batches(sampling))
    ours, theirs = sampled_tokens(cached), sampled_tokens(uncached)
    for request_id in ("b", "c"):
        matches = sum(a == b for a, b in zip(ours[request_id], theirs[request_id],
                                             strict=True))
        print(f"\n{start_options}: request {request_id}, cached vs recomputed prefix: "
              f"{matches}/{len(theirs[request_id])} greedy tokens equal")
        assert first_logprobs(cached)[request_id] == pytest.approx(
            first_logprobs(uncached)[request_id], abs=1e-3)


# -- the flag and the benchmark workload --------------------------------------------------


def test_the_flag_turns_prefix_caching_off_and_on() -> None:
    import argparse

    from trio_llm.api.cli import add_engine_arguments, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args([])).enable_prefix_caching
    off = engine_config_from_args(parser.parse_args(["--no-enable-prefix-caching"]))
    assert not off.enable_prefix_caching
    assert engine_config_from_args(
        parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching


def test_prefix_repetition_requests_share_their_prefixes() -> None:
    from trio_llm.api.bench_serve import prefix_repetition_requests

    make = dict(num_prompts=23, prefix_len=12, suffix_len=5, num_prefixes=4, output_len=7,
                vocab_size=50)
    requests = prefix_repetition_requests(seed=2, **make)  # type: ignore[arg-type]
    assert requests == prefix_repetition_requests(seed=2, **make)  # type: ignore[arg-type]
    assert requests != prefix_repetition_requests(seed=3, **make)  # type: ignore[arg-type]
    assert len(requests) == 23
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in requests} == {(17, 7)}
    by_prefix: dict[tuple[int, ...], int] = {}
    for request in requests:
        prefix = tuple(request.prompt_token_ids[:12])
        by_prefix[prefix] = by_prefix.get(prefix, 0) + 1
    assert sorted(by_prefix.values()) == [5, 6, 6, 6]
    assert len({tuple(r.prompt_token_ids[12:]) for r in requests}) == 23
    assert [tuple(r.prompt_token_ids[:12]) for r in requests[:6]] != [
        tuple(requests[0].prompt_token_ids[:12])] * 6, "shuffled"


async def test_bench_serve_prefix_repetition_reports_the_servers_hit_rate() -> None:
    from test_http_support import running_server

    from trio_llm.api.bench_serve import (
        BenchServeOptions,
        format_report,
        ideal_prefix_cache_hit_rate,
        run_benchmark,
    )

    with trio.fail_after(120):
        async with Engine.open(AMPLE) as engine, running_server(engine) as url:
            options = BenchServeOptions(
                base_url=url, num_prompts=16, max_concurrency=4, show_progress=False,
                dataset_name="prefix_repetition", prefix_repetition_prefix_len=64,
                prefix_repetition_suffix_len=8, prefix_repetition_num_prefixes=4,
                prefix_repetition_output_len=4)
            report, _ = await run_benchmark(options)
            statistics = engine.statistics()
    assert (report.num_completed, report.num_failed) == (16, 0)
    assert report.total_input_tokens == 16 * 72
    ideal = ideal_prefix_cache_hit_rate(options)
    assert ideal == pytest.approx(12 * 64 / (16 * 72))
    assert report.prefix_cache_hit_rate == pytest.approx(
        statistics.num_prefix_cache_hits / statistics.num_prefix_cache_queries)
    assert report.prefix_cache_hit_rate is not None
    assert 0.8 * ideal <= report.prefix_cache_hit_rate <= ideal
    assert "Prefix cache hit rate" in format_report(report)
