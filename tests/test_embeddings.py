"""Embeddings: a decoder checkpoint served with the pooling runner (Engine.embed,
POST /v1/embeddings).

A tiny random Qwen3 checkpoint written by transformers (with the built-in tiny
model's tokenizer) is pooled by the engine and by transformers' last hidden
state: last-token pooling with normalisation (the decoder default, Qwen3-Embedding's),
mean pooling where a sentence-transformers config says so, and Matryoshka
truncation. Our float32 vectors equal transformers' within 1e-5 per entry (the
reference runs the same float32 weights through other kernels; measured: at most
1.7e-7 for normalised vectors, 1.4e-6 for unnormalised means). On the CPU an embedding is
bit-identical alone or batched, chunked or not, from cached blocks or computed,
in-process or in the served layout.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
import trio
import trio.testing
from test_http_support import open_raw_request, openai_clients, running_server
from test_model_support import random_causal_lm

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import RequestRejected
from trio_llm.actors.messages import (
    NewRequestData,
    PooledOutput,
    PoolingOptions,
    PoolingParams,
    Request,
    SamplingOptions,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
    StepResult,
    TokenDelta,
    WaitingRequest,
)
from trio_llm.actors.pooling import PoolingConfigError, read_pooling_config
from trio_llm.actors.scheduler import Scheduler
from trio_llm.api.cli import add_engine_arguments, engine_config_from_args
from trio_llm.api.engine import Engine
from trio_llm.api.processes import open_served_layout
from trio_llm.gpu.builtin import resolve_model
from trio_llm.gpu.cuda_executor import CudaExecutorOptions, CudaModelExecutor
from trio_llm.gpu.executor import ModelExecutor
from trio_llm.gpu.loader import load_model
from trio_llm.gpu.testing import run_depth_1, run_depth_2

transformers = pytest.importorskip("transformers")

TIMEOUT = 120
# float32 through other kernels than transformers': measured differences ~1e-7
TOLERANCE = 1e-5
HIDDEN_SIZE = 64
PROMPTS = ["The cat sat by the fire and", "Once upon a time", "A",
           "the quick brown fox jumps over the lazy dog " * 6]
MATRYOSHKA_DIMENSIONS = [16, 32, 64]


def _with_files(source: Path, target: Path, files: dict[str, Any]) -> Path:
    """A copy of checkpoint ``source`` with ``files`` (relative path -> JSON) added."""
    shutil.copytree(source, target)
    for relative, content in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))
    return target


def _st_pooling(mode: str, normalize: bool) -> dict[str, Any]:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    modes = ["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken"]
    pooling = {f"pooling_mode_{name}": name == mode for name in modes}
    return {"modules.json": modules,
            "1_Pooling/config.json": {"word_embedding_dimension": HIDDEN_SIZE, **pooling,
                                      "include_prompt": True}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Checkpoint directories of one random Qwen3 model, pooled several ways, and the
    transformers model itself."""
    tiny = resolve_model("tiny")
    config = transformers.Qwen3Config(
        vocab_size=2048, hidden_size=HIDDEN_SIZE, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)
    model = random_causal_lm(config, seed=7)
    root = tmp_path_factory.mktemp("embedding")
    plain = root / "plain"
    model.save_pretrained(plain)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, plain / name)
    config_json = json.loads((plain / "config.json").read_text())
    return {
        "model": model.eval(),
        "last": plain,
        "mean": _with_files(plain, root / "mean", _st_pooling("mean_tokens", normalize=False)),
        "mean_normalized": _with_files(plain, root / "mean_normalized",
                                       _st_pooling("mean_tokens", normalize=True)),
        "matryoshka": _with_files(plain, root / "matryoshka", {
            "config.json": config_json | {"matryoshka_dimensions": MATRYOSHKA_DIMENSIONS}}),
    }


def engine_config(directory: Path, **fields: Any) -> EngineConfig:
    defaults: dict[str, Any] = dict(model=str(directory), runner="pooling", dtype="float32",
                                    device="cpu", num_kv_blocks=64, block_size=16,
                                    max_num_batched_tokens=512, max_model_len=256)
    return EngineConfig(**(defaults | fields))


def hidden_states(model: Any, token_ids: list[int]) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm) of one prompt."""
    with torch.no_grad():
        return model.model(torch.tensor([token_ids])).last_hidden_state[0]


def as_array(output: Any) -> np.ndarray:
    return np.frombuffer(output.data, dtype="<f4")


async def test_last_token_pooling_equals_transformers_alone_and_batched(checkpoints) -> None:
    model = checkpoints["model"]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(engine_config(checkpoints["last"])) as engine:
            alone = [await engine.embed(prompt) for prompt in PROMPTS]
            batched = await engine.embed_many(PROMPTS)
            stats = engine.statistics()
    for output, single in zip(batched, alone, strict=True):
        assert output.data == single.data  # bit for bit
        expected = F.normalize(hidden_states(model, output.prompt_token_ids)[-1], dim=-1)
        np.testing.assert_allclose(output.embedding, expected.numpy(), rtol=0, atol=TOLERANCE)
        assert len(output.embedding) == HIDDEN_SIZE
        assert np.isclose(np.linalg.norm(as_array(output)), 1.0, atol=1e-6)
    assert stats.num_generation_tokens == 0  # nothing was sampled
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


@pytest.mark.parametrize("variant", ["mean", "mean_normalized"])
async def test_mean_pooling_from_the_sentence_transformers_config(checkpoints, variant) -> None:
    model = checkpoints["model"]
    assert read_pooling_config(checkpoints[variant]).pooling_type == "mean"
    with trio.fail_after(TIMEOUT):
        async with Engine.open(engine_config(checkpoints[variant])) as engine:
            outputs = await engine.embed_many(PROMPTS)
    for output in outputs:
        expected = hidden_states(model, output.prompt_token_ids).mean(dim=0)
        if variant == "mean_normalized":
            expected = F.normalize(expected, dim=-1)
        np.testing.assert_allclose(output.embedding, expected.numpy(), rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("variant", ["last", "mean"])
async def test_chunked_prefill_and_the_prefix_cache_give_the_same_bits(checkpoints,
                                                                       variant) -> None:
    directory = checkpoints[variant]
    long_prompt = PROMPTS[-1]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(engine_config(directory, enable_prefix_caching=False)) as engine:
            reference = await engine.embed_many(PROMPTS)
        # chunks of 8 tokens, several requests sharing each step
        async with Engine.open(engine_config(directory, max_num_batched_tokens=8,
                                             enable_prefix_caching=False)) as engine:
            chunked = await engine.embed_many(PROMPTS)
        async with Engine.open(engine_config(directory)) as engine:
            first = await engine.embed(long_prompt)
            again = await engine.embed(long_prompt)  # its full blocks are cached now
            stats = engine.statistics()
    assert [output.data for output in chunked] == [output.data for output in reference]
    assert first.data == again.data == reference[-1].data
    if variant == "last":
        assert stats.num_prefix_cache_hits >= 16
    else:
        # every position's hidden state is pooled: a mean-pooled request computes them all
        assert stats.num_prefix_cache_hits == 0


async def test_matryoshka_dimensions_truncate_then_normalise(checkpoints) -> None:
    model = checkpoints["model"]
    with trio.fail_after(TIMEOUT):
        async with Engine.open(engine_config(checkpoints["matryoshka"])) as engine:
            cut = await engine.embed(PROMPTS[0], PoolingParams(dimensions=16))
            raw = await engine.embed(PROMPTS[0], PoolingParams(dimensions=32, normalize=False))
            with pytest.raises(RequestRejected, match=r"\[16, 32, 64\] only") as refused:
                await engine.embed(PROMPTS[0], PoolingParams(dimensions=20))
            assert refused.value.param == "dimensions"
        async with Engine.open(engine_config(checkpoints["last"])) as engine:
            with pytest.raises(RequestRejected, match="does not support Matryoshka") as refused:
                await engine.embed(PROMPTS[0], PoolingParams(dimensions=16))
            assert refused.value.param == "dimensions"
    last = hidden_states(model, cut.prompt_token_ids)[-1]
    np.testing.assert_allclose(cut.embedding, F.normalize(last[:16], dim=-1).numpy(), rtol=0,
                               atol=TOLERANCE)
    np.testing.assert_allclose(raw.embedding, last[:32].numpy(), rtol=0, atol=TOLERANCE)


async def test_refusals(checkpoints) -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(engine_config(checkpoints["last"], max_model_len=32)) as engine:
            with pytest.raises(RequestRejected, match="generates no text"):
                async for _ in engine.generate("Hello", SamplingParams(max_tokens=4)):
                    pass
            with pytest.raises(RequestRejected, match="empty") as refused:
                await engine.embed([])
            assert refused.value.param == "prompt"
            with pytest.raises(RequestRejected, match="maximum context length is 32 tokens, "
                                                      "but the input has 40"):
                await engine.embed(list(range(3, 43)))
            exactly_the_context = await engine.embed(list(range(3, 35)))
            assert exactly_the_context.num_prompt_tokens == 32
            truncated = await engine.embed(list(range(3, 43)),
                                           PoolingParams(truncate_prompt_tokens=-1))
            assert truncated.prompt_token_ids == list(range(11, 43))
            assert engine.statistics().num_free_blocks == 64
        async with Engine.open(engine_config(checkpoints["last"], runner="generate")) as engine:
            with pytest.raises(RequestRejected, match="--runner pooling") as refused:
                await engine.embed("Hello")
            assert refused.value.param == "model"


def test_pooling_configs_trio_llm_cannot_honour_are_start_up_errors(checkpoints,
                                                                     tmp_path) -> None:
    cls = _with_files(checkpoints["last"], tmp_path / "cls", _st_pooling("cls_token", True))
    with pytest.raises(PoolingConfigError, match="pooling_mode_cls_token"):
        read_pooling_config(cls)
    dense = _with_files(checkpoints["mean"], tmp_path / "dense", {})
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense",
                    "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingConfigError, match="Dense"):
        read_pooling_config(dense)
    default = read_pooling_config(checkpoints["last"])
    assert (default.pooling_type, default.normalize, default.is_matryoshka) == ("last", True,
                                                                                False)


async def test_the_served_layout_gives_the_in_process_bits(checkpoints) -> None:
    config = engine_config(checkpoints["last"])
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine:
            expected = await engine.embed_many(PROMPTS)
        async with open_served_layout(config, 2) as fronts:
            first = await fronts[0].embed_many(PROMPTS)
            second = [await fronts[1].embed(prompt) for prompt in PROMPTS]
            with pytest.raises(RequestRejected, match="generates no text"):
                async for _ in fronts[1].generate("Hello", SamplingParams(max_tokens=2)):
                    pass
    assert [output.data for output in first] == [output.data for output in expected]
    assert [output.data for output in second] == [output.data for output in expected]


# -- over HTTP, through the openai SDK -------------------------------------------------


@asynccontextmanager
async def served_embeddings(config: EngineConfig, layout: str) -> AsyncIterator[tuple[Engine,
                                                                                        str]]:
    """(an engine for in-process requests, the URL of a server over the same core)."""
    if layout == "in-process":
        async with Engine.open(config) as engine, running_server(engine) as url:
            yield engine, url
        return
    async with open_served_layout(config, 2) as (http_front, other_front):
        async with running_server(http_front) as url:
            yield other_front, url


@pytest.mark.parametrize("layout", ["in-process", "served"])
async def test_the_openai_client_gets_the_engines_embeddings(checkpoints, layout) -> None:
    token_ids = [[5, 6, 7, 8], [9, 10]]
    with trio.fail_after(TIMEOUT):
        async with served_embeddings(engine_config(checkpoints["last"]), layout) as (engine,
                                                                                     url):
            expected = await engine.embed_many(PROMPTS)
            expected_ids = await engine.embed_many(token_ids)
            async with openai_clients(url) as (client, _):
                as_floats = await client.embeddings.create(model=str(checkpoints["last"]),
                                                           input=PROMPTS,
                                                           encoding_format="float")
                as_base64 = await client.embeddings.create(model=str(checkpoints["last"]),
                                                           input=PROMPTS,
                                                           encoding_format="base64")
                # without a format the SDK asks for base64 and decodes it itself
                decoded = await client.embeddings.create(input=PROMPTS[0],
                                                         model=str(checkpoints["last"]))
                by_ids = await client.embeddings.create(input=token_ids,
                                                        model=str(checkpoints["last"]))
                one_list = await client.embeddings.create(input=token_ids[0],
                                                          model=str(checkpoints["last"]))
    assert [item.index for item in as_floats.data] == list(range(len(PROMPTS)))
    assert [item.embedding for item in as_floats.data] == [output.embedding
                                                           for output in expected]
    assert [base64.b64decode(item.embedding) for item in as_base64.data] == [
        output.data for output in expected]
    assert decoded.data[0].embedding == expected[0].embedding
    assert [item.embedding for item in by_ids.data] == [output.embedding
                                                        for output in expected_ids]
    assert one_list.data[0].embedding == expected_ids[0].embedding
    num_prompt_tokens = sum(output.num_prompt_tokens for output in expected)
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens == num_prompt_tokens
    assert by_ids.usage.prompt_tokens == 6
    assert as_floats.object == "list" and as_floats.data[0].object == "embedding"


async def test_http_refusals(checkpoints) -> None:
    model = str(checkpoints["last"])
    with trio.fail_after(TIMEOUT):
        async with served_embeddings(engine_config(checkpoints["last"], max_model_len=32),
                                     "in-process") as (_, url):
            async with openai_clients(url) as (client, _):
                refusals = {}
                for name, fields in {
                    "empty string": {"input": ""},
                    "empty list": {"input": []},
                    "empty ids": {"input": [[1, 2], []]},
                    "mixed": {"input": ["a", [1, 2]]},
                    "too long": {"input": list(range(3, 43))},
                    "dimensions": {"input": "a", "dimensions": 16},
                    "zero dimensions": {"input": "a", "dimensions": 0},
                    "embed_dtype": {"input": "a", "extra_body": {"embed_dtype": "float16"}},
                }.items():
                    with pytest.raises(openai.BadRequestError) as refused:
                        await client.embeddings.create(model=model, **fields)
                    refusals[name] = refused.value.body
                with pytest.raises(openai.BadRequestError, match="generates no text"):
                    await client.completions.create(model=model, prompt="Hi", max_tokens=2)
                with pytest.raises(openai.BadRequestError, match="generates no text"):
                    await client.chat.completions.create(
                        model=model, messages=[{"role": "user", "content": "Hi"}])
        async with Engine.open(EngineConfig(model="tiny", num_kv_blocks=16)) as engine:
            async with running_server(engine) as url, openai_clients(url) as (client, _):
                with pytest.raises(openai.BadRequestError, match="--runner pooling"):
                    await client.embeddings.create(model="tiny", input="Hello")
    assert refusals["empty string"]["param"] == "input"
    assert refusals["empty list"]["param"] == "input"
    assert refusals["empty ids"]["param"] == "input[1]"
    assert refusals["mixed"]["param"] == "input[1]"
    assert "maximum context length is 32 tokens" in refusals["too long"]["message"]
    assert refusals["dimensions"]["param"] == "dimensions"
    assert refusals["zero dimensions"]["param"] == "dimensions"
    assert refusals["embed_dtype"]["param"] == "embed_dtype"


# -- the scheduler's part, without trio -------------------------------------------------


def _request(request_id: str, prompt: list[int], *, max_tokens: int = 0,
             pooling: PoolingOptions | None = None, arrival_index: int = 0) -> WaitingRequest:
    sampling = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                               num_logprobs=None, min_tokens=0, banned_token_ids=[])
    return WaitingRequest(request=Request(
        request_id=request_id, prompt_token_ids=prompt, params=SamplingParams(),
        sampling=sampling, stop_token_ids=[], max_tokens=max_tokens, priority=0,
        arrival_index=arrival_index, arrival_time=0.0, pooling=pooling))


def _run_steps(scheduler: Scheduler, pulled: list[WaitingRequest]
               ) -> tuple[list[ScheduledBatch], list[TokenDelta]]:
    """Plan, 'execute' (token 7 for a sampled row, a fixed vector for a pooled one) and
    reconcile at the scheduler's depth until it is idle."""
    batches: list[ScheduledBatch] = []
    deltas: list[TokenDelta] = []
    in_flight: deque[ScheduledBatch] = deque()
    while True:
        while scheduler.can_plan_step():
            plan = scheduler.schedule(pulled)
            pulled = plan.requeue.requests if plan.requeue is not None else []  # the queue's part
            if plan.batch is None:
                break
            in_flight.append(plan.batch)
            batches.append(plan.batch)
        if not in_flight and not pulled:
            return batches, deltas
        if not in_flight:
            continue
        batch = in_flight.popleft()
        sampled = [scheduled.request_id for scheduled in batch.requests if scheduled.sample]
        pooled = [PooledOutput(request_id=scheduled.request_id, data=VECTOR)
                  for scheduled in batch.requests if scheduled.pool]
        tokens = scheduler.on_step_result(StepResult(
            step_id=batch.step_id, request_ids=sampled, sampled_token_ids=[7] * len(sampled),
            pooled=pooled))
        if tokens is not None:
            deltas += tokens.deltas


VECTOR = np.array([0.6, 0.8], dtype="<f4").tobytes()


@pytest.mark.parametrize("depth", [1, 2])
def test_an_embedding_request_is_a_prefill_that_finishes_with_its_vector(depth: int) -> None:
    config = EngineConfig(block_size=4, max_num_batched_tokens=8, pipeline_depth=depth)
    scheduler = Scheduler(config, num_kv_blocks=32)
    last = PoolingOptions(pooling_type="last", normalize=True)
    pulled = [_request("embed", list(range(1, 19)), pooling=last),
              _request("generate", [1, 2, 3], max_tokens=3, arrival_index=1)]
    batches, deltas = _run_steps(scheduler, pulled)
    chunks = [scheduled for batch in batches for scheduled in batch.requests
              if scheduled.request_id == "embed"]
    assert sum(len(chunk.token_ids) for chunk in chunks) == 18 and len(chunks) >= 3
    assert [chunk.pool for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert not any(chunk.sample for chunk in chunks)  # it never decodes
    new_requests = [new for batch in batches for new in batch.new_requests]
    assert [new.pooling for new in new_requests if new.request_id == "embed"] == [last]
    (finished,) = [delta for delta in deltas if delta.request_id == "embed"]
    assert (finished.token_ids, finished.finish_reason, finished.embedding) == ([], "stop",
                                                                                VECTOR)
    assert [delta.token_ids for delta in deltas if delta.request_id == "generate"] == [[7]] * 3
    assert scheduler.is_idle and scheduler.block_manager.num_free_blocks == 32
    assert scheduler.num_generation_tokens == 3


def test_a_mean_pooled_request_never_starts_from_cached_blocks() -> None:
    config = EngineConfig(block_size=4, max_num_batched_tokens=64, pipeline_depth=1)
    prompt = list(range(1, 14))
    for pooling_type, num_cached_tokens in (("last", 12), ("mean", 0)):
        scheduler = Scheduler(config, num_kv_blocks=32)
        pooling = PoolingOptions(pooling_type=pooling_type, normalize=False)
        _run_steps(scheduler, [_request("first", prompt, pooling=pooling)])
        batches, _ = _run_steps(scheduler, [_request("again", prompt, pooling=pooling)])
        assert batches[0].requests[0].num_computed_tokens == num_cached_tokens


def test_task_embed_is_the_pooling_runner(checkpoints, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)

    def config_of(*flags: str) -> EngineConfig:
        return engine_config_from_args(parser.parse_args(["--model", str(checkpoints["last"]),
                                                          *flags]))

    assert config_of().runner == "generate"
    assert config_of("--task", "embed").runner == "pooling"
    assert config_of("--runner", "pooling").runner == "pooling"
    with pytest.raises(SystemExit, match="contradicts"):
        config_of("--task", "embed", "--runner", "generate")
    cls = _with_files(checkpoints["last"], tmp_path / "cls", _st_pooling("cls_token", True))
    with pytest.raises(SystemExit, match="--runner pooling: .*pooling_mode_cls_token"):
        engine_config_from_args(parser.parse_args(["--model", str(cls), "--task", "embed"]))


# -- CUDA (the pipelined executor): skipped without a GPU -------------------------------

# float32 on CUDA: the Triton kernels' dot products run in TF32 (10-bit mantissa)
CUDA_TOLERANCE = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["last", "mean"])
async def test_cuda_embeddings_equal_transformers_chunked_batched_and_cached(checkpoints,
                                                                             variant) -> None:
    model = checkpoints["model"]
    results = {}
    with trio.fail_after(TIMEOUT):
        for name, fields in {"whole": {}, "chunked": {"max_num_batched_tokens": 8}}.items():
            config = engine_config(checkpoints[variant], device="cuda", **fields)
            async with Engine.open(config) as engine:
                results[name] = await engine.embed_many(PROMPTS)
                results[f"{name} alone"] = [await engine.embed(prompt) for prompt in PROMPTS]
                results[f"{name} again"] = [await engine.embed(PROMPTS[-1])]  # cached blocks
    for outputs in results.values():
        for output in outputs:
            states = hidden_states(model, output.prompt_token_ids)
            expected = F.normalize(states[-1], dim=-1) if variant == "last" else states.mean(0)
            np.testing.assert_allclose(output.embedding, expected.numpy(), rtol=0,
                                       atol=CUDA_TOLERANCE)


# -- the executors: the pipelined one (its bookkeeping on the CPU) against the plain one --


def _embedding_batches(*, chunked: bool) -> list[ScheduledBatch]:
    """A generating request beside two embedding requests (last-token and mean pooling),
    whose 8-token prompts run in two chunks or in one."""
    last = PoolingOptions(pooling_type="last", normalize=True)
    mean = PoolingOptions(pooling_type="mean", normalize=False, dimensions=48)
    greedy = SamplingOptions(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                             num_logprobs=None, min_tokens=0, banned_token_ids=[])

    def row(request_id: str, token_ids: list[int] | None, *, computed: int,
            blocks: tuple[int, ...] = (), sample: bool = False, pool: bool = False,
            output_index: int = 0) -> ScheduledRequest:
        return ScheduledRequest(request_id=request_id, token_ids=token_ids or [],
                                input_from_previous_step=token_ids is None,
                                num_computed_tokens=computed, new_block_ids=list(blocks),
                                sample=sample, output_index=output_index, pool=pool)

    embed_prompt, mean_prompt = [10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]
    new = [NewRequestData(request_id="gen", sampling=greedy),
           NewRequestData(request_id="last", sampling=greedy, pooling=last),
           NewRequestData(request_id="mean", sampling=greedy, pooling=mean)]
    first = [row("gen", [5, 9, 14, 200, 31, 7], computed=0, blocks=(0, 1), sample=True)]
    if chunked:
        first += [row("last", embed_prompt[:5], computed=0, blocks=(2, 3)),
                  row("mean", mean_prompt[:3], computed=0, blocks=(4,))]
        second = [row("last", embed_prompt[5:], computed=5, pool=True),
                  row("mean", mean_prompt[3:], computed=3, blocks=(5,), pool=True)]
    else:
        first += [row("last", embed_prompt, computed=0, blocks=(2, 3), pool=True),
                  row("mean", mean_prompt, computed=0, blocks=(4, 5), pool=True)]
        second = []
    return [
        ScheduledBatch(step_id=0, new_requests=new, requests=first, finished_request_ids=[],
                       num_tokens=sum(len(r.token_ids) for r in first)),
        ScheduledBatch(step_id=1, new_requests=[],
                       requests=[row("gen", None, computed=6, output_index=1), *second],
                       finished_request_ids=[], num_tokens=1 + sum(len(r.token_ids)
                                                                   for r in second)),
        ScheduledBatch(step_id=2, new_requests=[],
                       requests=[row("gen", None, computed=7, output_index=2)],
                       finished_request_ids=["last", "mean"], num_tokens=1),
    ]


def _pooled(results: list[StepResult]) -> dict[str, bytes]:
    return {pooled.request_id: pooled.data for result in results for pooled in result.pooled}


@pytest.mark.parametrize("use_cuda_graphs", [False, True])
def test_the_pipelined_executor_pools_what_the_plain_one_does(checkpoints,
                                                              use_cuda_graphs) -> None:
    cpu = torch.device("cpu")
    directory = checkpoints["last"]

    def build(executor_class: type[ModelExecutor]) -> ModelExecutor:
        model = load_model(directory, dtype=torch.float32, device=cpu)
        return executor_class(model, model_path=directory, num_kv_blocks=16, block_size=4,
                              max_model_len=256)

    expected = run_depth_1(build(ModelExecutor), _embedding_batches(chunked=True))
    unchunked = run_depth_1(build(ModelExecutor), _embedding_batches(chunked=False))
    pipelined = build(CudaModelExecutor)
    assert isinstance(pipelined, CudaModelExecutor)
    pipelined.start(CudaExecutorOptions(max_num_seqs=4, use_cuda_graphs=use_cuda_graphs,
                                        use_fused_kernels=False, max_num_batched_tokens=64))
    results = run_depth_2(pipelined, _embedding_batches(chunked=True))
    assert sorted(_pooled(expected)) == ["last", "mean"]
    assert [result.pooled for result in expected[:1]] == [[]]  # no last chunk in step 0
    assert _pooled(results) == _pooled(expected) == _pooled(unchunked)
    assert [r.sampled_token_ids for r in results] == [r.sampled_token_ids for r in expected]
    assert len(_pooled(expected)["mean"]) == 48 * 4  # cut to its dimensions
    if use_cuda_graphs:  # steps with pooling run eagerly; the decode-only one from a graph
        assert pipelined.stats.num_graph_steps == 1


async def test_two_tensor_parallel_ranks_pool_what_one_does(checkpoints) -> None:
    """Rank 0's result carries the vectors; every rank pools the same all-reduced states
    (up to the split sums' float32 rounding, as tokens' logprobs at TP 2)."""
    config = engine_config(checkpoints["mean_normalized"], max_num_batched_tokens=16)
    with trio.fail_after(2 * TIMEOUT):
        async with Engine.open(config) as engine:
            expected = await engine.embed_many(PROMPTS)
        async with Engine.open(msgspec.structs.replace(config, tensor_parallel_size=2)) as engine:
            found = await engine.embed_many(PROMPTS)
    for ours, reference in zip(found, expected, strict=True):
        np.testing.assert_allclose(ours.embedding, reference.embedding, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("variant", ["last", "mean"])
async def test_a_preempted_embedding_request_pools_what_it_would_alone(checkpoints,
                                                                       variant) -> None:
    """A 190-token prompt, then two of 60, in chunks of 40 through a KV cache of 14
    blocks of 16: the second starts beside the first's last chunk (12 blocks); when its
    next chunk is planned while that last chunk runs (depth 2), the first's blocks are
    still held and a prompt that cannot grow is preempted, recomputed later, and pools
    the same bits (a mean-pooled one starts its sum over). Whether the plan comes
    before the last chunk's result is timing (a loaded machine may plan late), so the
    batch runs until a run preempted, at most five times, each run checked."""
    directory = checkpoints[variant]
    prompts = [list(range(3, 193)), list(range(300, 360)), list(range(400, 460))]
    tight = engine_config(directory, num_kv_blocks=14, pipeline_depth=2,
                          max_num_batched_tokens=40)
    with trio.fail_after(6 * TIMEOUT):
        async with Engine.open(engine_config(directory)) as engine:
            expected = [output.data for output in [await engine.embed(p) for p in prompts]]
        for _ in range(5):
            async with Engine.open(tight) as engine:
                found = await engine.embed_many(prompts)
                num_preemptions = engine.statistics().num_preemptions
            assert [output.data for output in found] == expected
            if num_preemptions:
                break
    assert num_preemptions > 0


async def wait_for(predicate: Any) -> None:
    """Let every task run until ``predicate`` holds: bounded by the caller's fail_after,
    not by a count of rounds (a loaded machine may take many rounds a step)."""
    while not predicate():
        await trio.testing.wait_all_tasks_blocked()


async def test_a_client_that_goes_away_aborts_its_inputs(checkpoints) -> None:
    inputs = [list(range(3 + index, 103 + index)) for index in range(64)]  # 6,400 tokens
    config = engine_config(checkpoints["last"], max_num_batched_tokens=16, max_num_seqs=2)
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine, running_server(engine) as url:
            connection = await open_raw_request(url, "/v1/embeddings", {"input": inputs})
            await wait_for(lambda: engine.statistics().num_running > 0)
            await connection.aclose()
            await wait_for(lambda: engine.num_open_requests == 0)
            await engine.embed([5, 6, 7])  # after the aborts (intake's inbox is FIFO)
            stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_prompt_tokens < 6400  # most inputs never ran
