"""Hostile HTTP clients: bodies that do not decode, wrong content types,
bodies over the limit on a kept-alive connection, a request that fails inside
the engine, and the OpenAPI document the server publishes."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from test_http_server import error_of, get, post
from test_http_support import FakeEngine, host_port, running_server, sse_json

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.detokenizer import StopStrings
from trio_llm.actors.intake import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from trio_llm.api.engine import Engine

TIMEOUT = 30


async def post_raw(url: str, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with httpx.AsyncClient(base_url=url) as client:
        return await client.post(path, content=body, headers=headers)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
async def test_json_nested_too_deeply_is_a_400(path: str) -> None:
    nested = b'{"prompt": "x", "unknown": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url:
            response = await post_raw(url, path, nested, "application/json")
    assert response.status_code == 400
    assert "nests" in error_of(response)["message"]


@pytest.mark.parametrize(("content_type", "status"),
                         [(None, 200), ("application/json", 200),
                          ("application/json; charset=utf-8", 200),
                          ("application/merge-patch+json", 200),
                          ("text/plain", 400), ("application/x-www-form-urlencoded", 400)])
async def test_a_body_is_json_only_when_its_content_type_says_so(content_type: str | None,
                                                                 status: int) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url:
            response = await post_raw(url, "/v1/completions", body, content_type)
    assert response.status_code == status
    if status == 400:
        assert error_of(response)["param"] == "Content-Type"


@pytest.mark.parametrize(
    ("stop", "words"),
    [(["x"] * (MAX_STOP_STRINGS + 1), f"length <= {MAX_STOP_STRINGS}"),
     ("x" * (MAX_STOP_STRING_CHARS + 1), f"length <= {MAX_STOP_STRING_CHARS}"),
     ("x" * 1_000_000, f"length <= {MAX_STOP_STRING_CHARS}")])
async def test_stop_strings_over_the_bounds_are_a_400_naming_stop(stop: Any, words: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url:
            response = await post(url, "/v1/completions",
                                  {"prompt": "hi", "max_tokens": 2, "stop": stop})
            assert (await get(url, "/health")).status_code == 200
    error = error_of(response)
    assert (response.status_code, error["param"]) == (400, "stop")
    assert words in error["message"]


async def receive_response(stream: trio.SocketStream) -> bytes:
    """One whole response with a Content-Length: head and body."""
    received = b""
    while b"\r\n\r\n" not in received:
        data = await stream.receive_some(65536)
        assert data, "closed before the response head"
        received += data
    head, _, body = received.partition(b"\r\n\r\n")
    length_line = next(line for line in head.lower().split(b"\r\n")
                       if line.startswith(b"content-length:"))
    num_body_bytes = int(length_line.split(b":")[1])
    while len(body) < num_body_bytes:
        data = await stream.receive_some(65536)
        assert data, "closed inside the response body"
        body += data
    return head


async def next_request_outcome(stream: trio.SocketStream) -> str:
    """Send a second request on the connection: "answered", "closed" or "hung"."""
    with trio.move_on_after(5):  # real time: a hang is what this looks for
        try:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:
            return "closed"
        return "closed" if not data else repr(data[:12])
    return "hung"


async def test_a_413_on_a_kept_alive_connection_closes_it_instead_of_hanging() -> None:
    body = b'{"prompt": "' + b"x" * 4_000_000 + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    outcomes = []
    with trio.fail_after(8 * 5 + TIMEOUT):
        async with running_server(FakeEngine(), max_body_bytes=1000) as url:
            # Hypercorn's close races Quart-Trio's cancellation: try it often.
            for _ in range(8):
                stream = await trio.open_tcp_stream(*host_port(url))
                async with trio.open_nursery() as nursery:
                    sent = trio.Event()

                    async def send_body(stream: trio.SocketStream = stream,
                                        sent: trio.Event = sent) -> None:
                        try:
                            await stream.send_all(head + body)
                        except trio.BrokenResourceError:
                            pass  # the server closed the connection mid-body
                        sent.set()

                    nursery.start_soon(send_body)
                    response_head = await receive_response(stream)
                    await sent.wait()
                    outcomes.append(await next_request_outcome(stream))
                await stream.aclose()
    assert response_head.startswith(b"HTTP/1.1 413")
    assert b"connection: close" in response_head.lower()
    assert set(outcomes) == {"closed"}


async def test_a_4xx_after_the_whole_body_leaves_the_connection_ready() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url, httpx.AsyncClient(base_url=url) as client:
            bad = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            good = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert (bad.status_code, good.status_code) == (400, 200)
    assert "close" not in bad.headers.get("connection", "")


async def test_openapi_json_is_the_schema_the_server_decodes_with() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(), api_key="secret") as url:
            response = await get(url, "/openapi.json")
    assert response.status_code == 200  # open, like /health
    document = response.json()
    assert document["openapi"].startswith("3.1")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize",
            "/detokenize", "/health", "/metrics"} <= set(document["paths"])
    stop = document["components"]["schemas"]["CompletionRequest"]["properties"]["stop"]
    assert {"type": "array", "maxItems": MAX_STOP_STRINGS,
            "items": {"type": "string", "minLength": 1,
                      "maxLength": MAX_STOP_STRING_CHARS}} in stop["anyOf"]
    errors = document["paths"]["/v1/completions"]["post"]["responses"]["400"]
    assert errors["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")


# -- a request that fails inside the engine ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_failing_in_the_detokenizer_gets_a_500_and_others_go_on(
        monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    original_find = StopStrings.find
    num_calls = 0
    # Streamed, it fails after the first chunk went out (so within the 200).
    fail_at_call = 3 if stream else 1

    def find(self: StopStrings, text: str, num_old_chars: int) -> Any:
        nonlocal num_calls
        if "victim-stop" in self.stops:
            num_calls += 1
            if num_calls >= fail_at_call:
                raise RuntimeError("injected stop string failure")
        return original_find(self, text, num_old_chars)

    monkeypatch.setattr(StopStrings, "find", find)
    config = EngineConfig(model="tiny", num_kv_blocks=64, max_num_seqs=8)
    with trio.fail_after(60):
        async with Engine.open(config) as engine, running_server(engine) as url:
            request = {"prompt": "hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            before = await post(url, "/v1/completions", request)
            failed = await post(url, "/v1/completions",
                                {**request, "stop": ["victim-stop"], "stream": stream})
            after = await post(url, "/v1/completions", request)
            health = await get(url, "/health")
    if stream:
        assert failed.status_code == 200  # the failure came after the first token
        events = sse_json(failed.text)
        assert events[0]["choices"][0]["text"]
        assert events[-1]["error"]["type"] == "server_error"
        assert "injected stop string failure" in events[-1]["error"]["message"]
        assert failed.text.endswith("data: [DONE]\n\n")
    else:
        error = error_of(failed)
        assert (failed.status_code, error["type"]) == (500, "server_error")
        assert "injected stop string failure" in error["message"]
    assert before.json()["choices"] == after.json()["choices"]
    assert health.status_code == 200


# -- values decided deliberately, over HTTP -------------------------------------------------


GREEDY_FIELDS = {"max_tokens": 4, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "fields", "status"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 200),
        ("/v1/completions", {"prompt": "hi", "temperature": 1e308}, 200),
        ("/v1/completions", {"prompt": "hi", "top_p": 1e-300}, 200),
        ("/v1/completions", {"prompt": "hi", "top_k": 2**63}, 200),
        ("/v1/completions", {"prompt": "hi", "priority": 2**63 - 1}, 200),
        ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 10_000}, 400),
        ("/v1/completions", {"prompt": [1] * 100_000}, 400),
    ],
)
async def test_each_odd_but_legal_value_gets_the_answer_documented(path: str,
                                                                  fields: dict[str, Any],
                                                                  status: int) -> None:
    config = EngineConfig(model="tiny", num_kv_blocks=64, max_num_seqs=4,
                          scheduling_policy="priority")
    with trio.fail_after(60):
        async with Engine.open(config) as engine, running_server(engine) as url:
            response = await post(url, path, {**GREEDY_FIELDS, **fields})
            assert (await get(url, "/health")).status_code == 200
    assert response.status_code == status, response.text
    if status == 400:
        error_of(response)


async def test_a_response_to_a_request_asking_to_close_ends_with_the_connection() -> None:
    """Hypercorn closes such a connection from inside the app's last send, the
    same path as a 413's: the close must not be cancelled by the disconnect."""
    outcomes = []
    with trio.fail_after(8 * 5 + TIMEOUT):
        async with running_server(FakeEngine()) as url:
            for _ in range(8):
                stream = await trio.open_tcp_stream(*host_port(url))
                await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n"
                                      b"Connection: close\r\n\r\n")
                received = b""
                outcome = "hung"
                with trio.move_on_after(5):  # real time: a hang is what this looks for
                    while data := await stream.receive_some(65536):
                        received += data
                    outcome = "closed"
                outcomes.append(outcome)
                assert received.startswith(b"HTTP/1.1 200")
                await stream.aclose()
    assert set(outcomes) == {"closed"}


async def test_requests_stuck_in_worker_threads_never_hold_up_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Fifty /tokenize calls stuck in their threads at once: with trio's shared
    thread limiter (40 threads) they would starve the runner's steps; they
    hold up neither a stream already running nor a new completion."""
    import threading

    from trio_llm.api.server import OpenAIServer

    release = threading.Event()
    original = OpenAIServer._tokenized

    def stuck(self: OpenAIServer, body: Any) -> Any:
        release.wait(timeout=30)
        return original(self, body)

    monkeypatch.setattr(OpenAIServer, "_tokenized", stuck)
    config = EngineConfig(model="tiny", num_kv_blocks=64, max_num_seqs=4)
    request = {"prompt": "hi", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with trio.fail_after(60):
        async with Engine.open(config) as engine, running_server(engine) as url, \
                httpx.AsyncClient(base_url=url, timeout=60) as client:
            reference = (await post(url, "/v1/completions", request)).json()["choices"]
            async with trio.open_nursery() as nursery:
                for _ in range(50):
                    nursery.start_soon(partial(client.post, "/tokenize", json={"prompt": "hi"}))
                await trio.testing.wait_all_tasks_blocked()
                try:
                    with trio.fail_after(20):
                        response = await client.post("/v1/completions", json=request)
                finally:
                    release.set()
    assert response.json()["choices"] == reference


async def read_to_the_end(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = b""
    while data := await stream.receive_some(65536):
        received += data
    return received


SMUGGLED = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
CHUNKED_BODY = b'{"prompt": "hi", "max_tokens": 1}'
CHUNKED = f"{len(CHUNKED_BODY):x}\r\n".encode() + CHUNKED_BODY + b"\r\n0\r\n\r\n"

FRAMINGS = {
    "content-length and transfer-encoding": (
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
    "transfer-encoding and content-length": (
        b"Transfer-Encoding: chunked\r\nContent-Length: 200\r\n"),
    "obs-folded transfer-encoding": b"Transfer-Encoding:\r\n chunked\r\n",
    "obs-folded other header": b"X-Note: a\r\n\tb\r\nTransfer-Encoding: chunked\r\n",
}


@pytest.mark.parametrize("framing", list(FRAMINGS))
async def test_ambiguous_framing_is_a_400_and_the_connection_closes(framing: str) -> None:
    """Request smuggling (RFC 9112, 6.3): both lengths, or an obs-folded header, get a
    400 and the connection is closed at once, so the request hidden behind the body
    is never answered; over a real loopback socket, raw bytes."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + FRAMINGS[framing] + b"\r\n")
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url:
            stream = await trio.open_tcp_stream(*host_port(url))
            await stream.send_all(head + CHUNKED + SMUGGLED)
            received = await read_to_the_end(stream)
            await stream.aclose()
    assert received.startswith(b"HTTP/1.1 400"), received[:200]
    assert received.count(b"HTTP/1.1 ") == 1, "the smuggled request was answered"
    assert b"connection: close" in received.lower()


async def test_a_plain_chunked_request_is_still_served_and_kept_alive() -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url:
            stream = await trio.open_tcp_stream(*host_port(url))
            await stream.send_all(head + CHUNKED)
            response_head = await receive_response(stream)
            outcome = await next_request_outcome(stream)
            await stream.aclose()
    assert response_head.startswith(b"HTTP/1.1 200")
    assert outcome.startswith("b'HTTP/1.1 200"), outcome
