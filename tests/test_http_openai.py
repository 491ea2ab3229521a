"""The server over the real engine and the built-in tiny model, through the
official `openai` client (async, and sync in a worker thread for streams), raw sockets for
disconnects, and the serving benchmark; each in both process layouts.

"served" is the served layout inside this process (api/processes.py,
``open_served_layout``): an engine core and two fronts joined by wire channels
over socket pairs. HTTP goes to the first front; in-process reference requests
and statistics go through the second, so every test crosses between fronts.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest
import trio
from test_http_support import open_raw_request, receive_until, running_server, wait_until

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.bench_serve import BenchServeOptions, run_benchmark
from trio_llm.api.engine import Engine
from trio_llm.api.processes import open_served_layout

CONFIG = EngineConfig(model="tiny", num_kv_blocks=64, block_size=16, max_num_seqs=8,
                      max_num_batched_tokens=256, max_model_len=256)
TIMEOUT = 120
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


LAYOUTS = ["in-process", "served"]
layouts = pytest.mark.parametrize("layout", LAYOUTS)


class Served:
    """A server under test: ``engine`` for in-process requests and statistics,
    ``http_engine`` the facade behind ``url`` (the same one in-process)."""

    def __init__(self, engine: Engine, http_engine: Engine, url: str) -> None:
        self.engine = engine
        self.http_engine = http_engine
        self.url = url


@asynccontextmanager
async def served_engine(layout: str, **server_options: Any) -> AsyncIterator[Served]:
    if layout == "in-process":
        async with Engine.open(CONFIG) as engine, running_server(engine, **server_options) as url:
            yield Served(engine, engine, url)
        return
    async with open_served_layout(CONFIG, 2) as (http_front, other_front):
        async with running_server(http_front, **server_options) as url:
            yield Served(other_front, http_front, url)


async def in_process_text(outputs: AsyncIterator[Any]) -> str:
    return "".join([output.text async for output in outputs])


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@layouts
async def test_openai_client_gets_what_the_engine_generates_in_process(layout: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout, api_key="secret") as served:
            engine, url = served.engine, served.url
            expected = await in_process_text(engine.generate(PROMPT, greedy(8)))
            expected_chat = await in_process_text(engine.chat(MESSAGES, greedy(6)))
            # Streams are read by the sync client in a worker thread: the async
            # client stops reading at [DONE] and leaves httpx's async generators
            # for the garbage collector, which trio reports as ResourceWarnings.
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
            sync_client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
            fields: dict[str, Any] = {"model": "tiny", "temperature": 0.0,
                                      "extra_body": {"ignore_eos": True}}

            def stream_completion() -> list[Any]:
                with sync_client.completions.create(
                        prompt=PROMPT, max_tokens=8, stream=True,
                        stream_options={"include_usage": True}, **fields) as stream:
                    return list(stream)

            def stream_chat() -> list[Any]:
                with sync_client.chat.completions.create(
                        messages=MESSAGES, max_tokens=6, stream=True,  # type: ignore[arg-type]
                        **fields) as stream:
                    return list(stream)

            try:
                completion = await client.completions.create(prompt=PROMPT, max_tokens=8,
                                                             **fields)
                chunks = await trio.to_thread.run_sync(stream_completion)
                chat = await client.chat.completions.create(
                    messages=MESSAGES, max_completion_tokens=6, **fields)  # type: ignore[arg-type]
                chat_chunks = await trio.to_thread.run_sync(stream_chat)
                models = await client.models.list()
            finally:
                await client.close()
                sync_client.close()
    assert completion.choices[0].text == expected
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected
    assert len([chunk for chunk in chunks if chunk.choices]) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    assert chat.choices[0].message.content == expected_chat
    assert chat.choices[0].finish_reason == "length"
    streamed_chat = "".join(chunk.choices[0].delta.content or "" for chunk in chat_chunks)
    assert streamed_chat == expected_chat
    assert [model.id for model in models.data] == ["tiny"]


@layouts
async def test_token_ids_and_a_truncated_prompt_come_back_in_either_layout(layout: str) -> None:
    """return_token_ids and truncate_prompt_tokens: intake and the detokenizer run in
    the API server, the model in the core; the ids are those the engine generates."""
    prompt_ids = [(5 * index + 7) % 300 + 10 for index in range(30)]
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served:
            outputs = [output async for output in served.engine.generate(prompt_ids[-6:],
                                                                          greedy(5))]
            client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none",
                                        max_retries=0)
            try:
                completion = await client.completions.create(
                    model="tiny", prompt=prompt_ids, max_tokens=5, temperature=0.0,
                    extra_body={"ignore_eos": True, "return_token_ids": True,
                                "truncate_prompt_tokens": 6})
            finally:
                await client.close()
    returned = completion.choices[0].model_extra or {}
    assert returned["prompt_token_ids"] == prompt_ids[-6:] == outputs[0].prompt_token_ids
    assert returned["token_ids"] == [token_id for output in outputs
                                     for token_id in output.token_ids]


@layouts
async def test_openai_client_sees_errors_as_exceptions(layout: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served:
            url = served.url
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            try:
                too_long = await _error_of(client.completions.create(
                    model="tiny", prompt=[7] * 300, max_tokens=4))
                no_room = await _error_of(client.completions.create(
                    model="tiny", prompt=[7] * 250, max_tokens=10))
                wrong_model = await _error_of(client.completions.create(
                    model="gpt-4", prompt="x", max_tokens=4))
                # The server is undisturbed.
                fine = await client.completions.create(model="tiny", prompt="x", max_tokens=2)
            finally:
                await client.close()
    assert isinstance(too_long, openai.BadRequestError)
    assert too_long.body["param"] == "prompt"  # type: ignore[index]
    assert "maximum context length" in too_long.body["message"]  # type: ignore[index]
    assert no_room.body["param"] == "max_tokens"  # type: ignore[index]
    assert isinstance(wrong_model, openai.NotFoundError)  # 404, as vLLM
    assert wrong_model.body["param"] == "model"  # type: ignore[index]
    assert "The model `gpt-4` does not exist" in wrong_model.body["message"]  # type: ignore[index]
    assert fine.usage is not None and fine.usage.completion_tokens == 2


async def _error_of(call: Any) -> openai.APIStatusError:
    try:
        await call
    except openai.APIStatusError as error:
        return error
    raise AssertionError("the request succeeded")


@layouts
async def test_dropped_connections_free_their_kv_blocks(layout: str) -> None:
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served:
            engine, url = served.engine, served.url
            # A stream, dropped after its first chunk.
            connection = await open_raw_request(url, "/v1/completions",
                                                {**request, "stream": True})
            await receive_until(connection, b'"text"')
            assert (await engine.fetch_statistics()).num_running == 1
            await connection.aclose()
            await _wait_engine_idle(served)
            after_stream = await engine.fetch_statistics()
            # A plain request, dropped once the engine has it.
            connection = await open_raw_request(url, "/v1/completions", request)
            await wait_until(lambda: served.http_engine.num_open_requests == 1)
            await connection.aclose()
            await _wait_engine_idle(served)
            stats = await engine.fetch_statistics()
            async with httpx.AsyncClient(base_url=url) as client:
                metrics = (await client.get("/metrics")).text
    for snapshot in (after_stream, stats):
        assert snapshot.num_running == 0
        assert snapshot.num_free_blocks == snapshot.num_total_blocks
    # Neither request ran to its 200 tokens.
    assert stats.num_generation_tokens < 200
    assert _metric(metrics, "vllm:num_requests_running") == 0.0
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert _metric(metrics, "vllm:generation_tokens_total") == stats.num_generation_tokens


async def _wait_engine_idle(served: Served) -> None:
    """Wait until the server closed the request's stream (its Abort is sent then),
    then run one more request on the same front: channels (and wire channels) are
    FIFO, so once it finished, the abort was handled."""
    await wait_until(lambda: served.http_engine.num_open_requests == 0)
    await in_process_text(served.http_engine.generate([5, 6, 7], greedy(2)))


@layouts
async def test_the_serving_benchmark_against_the_tiny_model(layout: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with served_engine(layout) as served:
            options = BenchServeOptions(base_url=served.url, num_prompts=6, random_input_len=16,
                                        random_output_len=8, max_concurrency=3,
                                        request_rate=200.0)
            report, _ = await run_benchmark(options)
            stats = await served.engine.fetch_statistics()
    assert (report.num_completed, report.num_failed) == (6, 0)
    assert report.total_output_tokens == 48
    assert report.total_input_tokens == 96
    assert stats.num_prompt_tokens >= 96
    assert report.ttft_ms.median > 0 and report.tpot_ms.median > 0


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(2))
