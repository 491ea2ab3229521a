"""trio_llm.api.client against a server on a loopback port: streaming, errors,
and cancel-safety (leaving or cancelling a stream aborts the request)."""

from __future__ import annotations

import pytest
import trio
from test_http_support import FakeEngine, running_server, wait_until

from trio_llm.api.client import CHAT_COMPLETIONS_PATH, CompletionClient, CompletionError

TIMEOUT = 10


async def test_stream_yields_chunks_then_usage() -> None:
    engine = FakeEngine()
    request = {"prompt": "hi", "max_tokens": 3, "stream_options": {"include_usage": True}}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url, CompletionClient(url) as client:
            async with client.stream(request) as chunks:
                received = [chunk async for chunk in chunks]
    assert [chunk.text for chunk in received] == ["a", "b", "c", ""]
    assert received[2].finish_reason == "length"
    assert received[3].usage is not None and received[3].usage.completion_tokens == 3
    times = [chunk.arrival_time for chunk in received]
    assert times == sorted(times)


async def test_stream_chat_reads_the_delta_content() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url, CompletionClient(url) as client:
            request = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
            async with client.stream(request, path=CHAT_COMPLETIONS_PATH) as chunks:
                text = "".join([chunk.text async for chunk in chunks])
    assert text == "ab"


async def test_complete_and_models() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url, CompletionClient(url) as client:
            body = await client.complete({"prompt": "hi", "max_tokens": 2})
            models = await client.models()
    assert body["choices"][0]["text"] == "ab"
    assert models[0]["id"] == "fake-model"


async def test_a_refused_request_raises_at_once() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url, CompletionClient(url) as client:
            with pytest.raises(CompletionError) as refused:
                async with client.stream({"prompt": "x", "max_tokens": 0}):
                    raise AssertionError("the stream must not open")
            with pytest.raises(CompletionError) as unauthorized:
                await client.complete({"prompt": "x", "top_k": -5})
    assert (refused.value.status, refused.value.param) == (400, "max_tokens")
    assert unauthorized.value.param == "top_k"


async def test_an_api_key_is_sent() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(), api_key="k") as url:
            async with CompletionClient(url, api_key="k") as client:
                body = await client.complete({"prompt": "x", "max_tokens": 1})
            async with CompletionClient(url) as client:
                with pytest.raises(CompletionError) as refused:
                    await client.complete({"prompt": "x", "max_tokens": 1})
    assert body["choices"][0]["text"] == "a"
    assert refused.value.status == 401


async def test_a_failure_mid_stream_raises_from_the_iteration() -> None:
    engine = FakeEngine(fail_after_tokens=1)
    texts: list[str] = []
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url, CompletionClient(url) as client:
            with pytest.raises(CompletionError) as failed:
                async with client.stream({"prompt": "x", "max_tokens": 5}) as chunks:
                    async for chunk in chunks:
                        texts.append(chunk.text)
    assert texts == ["a"]
    assert failed.value.status == 503


async def test_leaving_a_stream_early_aborts_the_request() -> None:
    engine = FakeEngine(gated=True)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url, CompletionClient(url) as client:
            engine.allow_steps(2)
            async with client.stream({"prompt": "x", "max_tokens": 50}) as chunks:
                async for chunk in chunks:
                    assert chunk.text == "a"
                    break
            await wait_until(lambda: not engine.running)
    assert len(engine.aborted) == 1


async def test_cancelling_a_stream_aborts_the_request() -> None:
    engine = FakeEngine(gated=True)
    received: list[str] = []
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url, CompletionClient(url) as client:
            engine.allow_steps(1)
            with trio.CancelScope() as scope:
                async with client.stream({"prompt": "x", "max_tokens": 50}) as chunks:
                    async for chunk in chunks:
                        received.append(chunk.text)
                        # The engine is gated: the next read waits until cancelled.
                        scope.cancel()
            await wait_until(lambda: not engine.running)
    assert scope.cancelled_caught
    assert received == ["a"]
    assert len(engine.aborted) == 1


async def test_cancelling_while_waiting_for_the_first_token_aborts_the_request() -> None:
    engine = FakeEngine(gated=True)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url, CompletionClient(url) as client:
            async with trio.open_nursery() as nursery:

                async def stream_forever() -> None:
                    async with client.stream({"prompt": "x", "max_tokens": 5}) as chunks:
                        async for _ in chunks:
                            raise AssertionError("no token was allowed")

                nursery.start_soon(stream_forever)
                await wait_until(lambda: bool(engine.running))
                nursery.cancel_scope.cancel()
            await wait_until(lambda: not engine.running)
    assert len(engine.aborted) == 1
