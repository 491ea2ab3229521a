"""Real streaming and disconnects, over raw loopback sockets and a gated engine
(each engine step waits for the test's permission)."""

from __future__ import annotations

import re

import httpx
import msgspec
import trio
from test_http_support import (
    FakeEngine,
    open_raw_request,
    receive_until,
    running_server,
    wait_until,
)

from trio_llm.actors.messages import SamplingParams
from trio_llm.api import protocol
from trio_llm.api.server import OpenAIServer, ServerConfig

TIMEOUT = 10


async def test_each_chunk_is_on_the_wire_before_the_next_token_exists() -> None:
    engine = FakeEngine(gated=True)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                request = {"prompt": "x", "max_tokens": 3, "stream": True}
                # The status line waits for the first token (a rejection is a 4xx).
                engine.allow_steps(1)
                async with client.stream("POST", "/v1/completions", json=request) as response:
                    lines = response.aiter_lines()
                    received: list[tuple[str, int]] = []
                    for step in range(3):
                        if step:
                            engine.allow_steps(1)
                        line = await _next_data_line(lines)
                        received.append((line, engine.num_generated))
                    rest = [line async for line in lines if line.startswith("data: ")]
    # Every chunk arrived while the engine had produced exactly its token.
    assert [num_generated for _, num_generated in received] == [1, 2, 3]
    assert ['"text":"a"' in received[0][0], '"text":"c"' in received[2][0]] == [True, True]
    assert rest == ["data: [DONE]"]


async def _next_data_line(lines: object) -> str:
    async for line in lines:  # type: ignore[attr-defined]
        if line.startswith("data: "):
            return str(line)
    raise AssertionError("the stream ended")


async def test_dropping_a_stream_mid_way_aborts_the_request() -> None:
    engine = FakeEngine(gated=True)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            connection = await open_raw_request(
                url, "/v1/completions", {"prompt": "x", "max_tokens": 50, "stream": True})
            engine.allow_steps(2)
            received = await receive_until(connection, b'"text":"b"')
            assert received.startswith(b"HTTP/1.1 200 ")
            [request_id] = engine.running
            await connection.aclose()
            await wait_until(lambda: not engine.running)
            async with httpx.AsyncClient(base_url=url) as client:
                metrics = (await client.get("/metrics")).text
    assert engine.aborted == [request_id]
    assert engine.num_generated == 2
    assert _metric(metrics, "vllm:num_requests_running") == 0.0
    assert _metric(metrics, "vllm:kv_cache_usage_perc") == 0.0


async def test_dropping_a_plain_request_aborts_it() -> None:
    engine = FakeEngine(gated=True)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            connection = await open_raw_request(url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50})
            engine.allow_steps(3)
            await wait_until(lambda: engine.num_generated == 3)
            [request_id] = engine.running
            await connection.aclose()
            await wait_until(lambda: not engine.running)
    assert engine.aborted == [request_id]


async def test_dropping_a_stream_before_its_first_token_aborts_it() -> None:
    engine = FakeEngine(gated=True)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            connection = await open_raw_request(
                url, "/v1/completions", {"prompt": "x", "max_tokens": 5, "stream": True})
            await wait_until(lambda: bool(engine.running))
            await connection.aclose()
            await wait_until(lambda: not engine.running)
    assert len(engine.aborted) == 1
    assert engine.num_generated == 0


async def test_other_requests_go_on_when_one_client_leaves() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            gated = FakeEngine(gated=True)
            async with running_server(gated) as gated_url:
                leaving = await open_raw_request(
                    gated_url, "/v1/completions", {"prompt": "x", "max_tokens": 9,
                                                   "stream": True})
                await wait_until(lambda: bool(gated.running))
                await leaving.aclose()
            async with httpx.AsyncClient(base_url=url) as client:
                staying = await client.post("/v1/completions", json={"prompt": "x",
                                                                     "max_tokens": 4})
    assert staying.json()["choices"][0]["text"] == "abcd"


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


async def test_closing_the_body_at_a_chunk_aborts_the_request() -> None:
    """The other disconnect path: the client leaves while the server is parked
    at a chunk (its send was blocked), so Quart closes the body generator."""
    engine = FakeEngine(gated=True)
    api = OpenAIServer(engine, ServerConfig())
    body = msgspec.convert({"prompt": "x", "max_tokens": 5, "stream": True},
                           protocol.CompletionRequest)
    builder = protocol.CompletionBuilder(response_id="cmpl-1", model="fake-model",
                                         token_text=chr)
    engine.allow_steps(2)
    with trio.fail_after(TIMEOUT):
        response = await api.respond(engine.generate("x", SamplingParams(max_tokens=5),
                                                     request_id="cmpl-1"), builder, body)
        async with response.response as chunks:
            async for data in chunks:
                assert b'"text":"a"' in data
                break
    assert engine.aborted == ["cmpl-1"]
    assert engine.running == set()
