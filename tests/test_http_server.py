"""The HTTP server over a scripted engine, through real loopback sockets:
response shapes, streaming, errors, authentication, draining."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing
from test_http_support import (
    FakeEngine,
    FakeTokenizer,
    host_port,
    running_server,
    sse_events,
    sse_json,
)

from trio_llm.api.server import ServerConfig
from trio_llm.api.serving import KEEP_ALIVE_SECONDS, LISTEN_BACKLOG, hypercorn_config

TIMEOUT = 10


async def post(url: str, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url) as client:
        return await client.post(path, json=body, **kwargs)


async def get(url: str, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url) as client:
        return await client.get(path, **kwargs)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == response.status_code
    return dict(body["error"])


# -- completions ----------------------------------------------------------------------


async def test_completion_returns_text_and_usage() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/completions",
                                  {"model": "fake-model", "prompt": "hello", "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "abc", "logprobs": None,
                                "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert engine.finished == [body["id"]]


async def test_completion_passes_sampling_fields_to_the_engine() -> None:
    engine = FakeEngine()
    request = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.5, "top_p": 0.9,
               "top_k": 7, "min_p": 0.1, "seed": 3, "stop": "zz", "stop_token_ids": [9],
               "ignore_eos": True, "min_tokens": 2, "priority": 4, "user": "u", "n": 1,
               "truncate_prompt_tokens": 2, "add_special_tokens": False}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/completions", request)
    assert response.status_code == 200
    [submitted] = engine.submitted
    params = submitted["params"]
    assert submitted["prompt"] == [5, 6, 7]
    assert submitted["priority"] == 4
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (4, 0.5, 0.9, 7)
    assert (params.min_p, params.seed, params.stop, params.stop_token_ids) == (0.1, 3, ["zz"], [9])
    assert (params.ignore_eos, params.min_tokens) == (True, 2)
    assert (params.truncate_prompt_tokens, params.add_special_tokens) == (2, False)


async def test_completion_logprobs_in_the_legacy_shape() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/completions",
                                  {"prompt": "x", "max_tokens": 2, "logprobs": 1})
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b"]
    assert logprobs["token_logprobs"] == [-0.25, -0.25]
    assert logprobs["top_logprobs"] == [{"a": -0.25}, {"b": -0.25}]
    assert logprobs["text_offset"] == [0, 1]
    assert engine.submitted[0]["params"].logprobs == 1


async def test_streamed_completion_sends_chunks_usage_and_done() -> None:
    engine = FakeEngine()
    request = {"prompt": "hi", "max_tokens": 3, "stream": True,
               "stream_options": {"include_usage": True}}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/completions", request)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert sse_events(response.text)[-1] == "[DONE]"
    chunks = sse_json(response.text)
    assert [chunk["choices"][0]["text"] for chunk in chunks[:-1]] == ["a", "b", "c"]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]] == [None, None,
                                                                               "length"]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert len({chunk["id"] for chunk in chunks}) == 1


async def test_streamed_completion_without_usage_ends_with_the_last_token() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/completions",
                                  {"prompt": "hi", "max_tokens": 2, "stream": True})
    chunks = sse_json(response.text)
    assert [chunk["choices"][0]["text"] for chunk in chunks] == ["a", "b"]


# -- chat -----------------------------------------------------------------------------


async def test_chat_completion_applies_the_chat_template() -> None:
    engine = FakeEngine()
    request = {"messages": [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
               "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/chat/completions", request)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert engine.submitted[0]["prompt"] == "<system>be brief<user>hi<assistant>"
    content = body["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == ["a", "b"]
    assert [top["token"] for top in content[0]["top_logprobs"]] == ["a", "b"]
    assert engine.submitted[0]["params"].logprobs == 2


async def test_chat_without_a_limit_may_fill_the_context() -> None:
    """No max_tokens reaches the engine as None: its intake resolves it to the
    room left after the prompt (tests/test_intake.py)."""
    engine = FakeEngine(max_model_len=40)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            await post(url, "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "hi"}]})
    assert engine.submitted[0]["params"].max_tokens is None


async def test_streamed_chat_starts_with_the_role() -> None:
    engine = FakeEngine()
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
               "stream_options": {"include_usage": True}}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/chat/completions", request)
    chunks = sse_json(response.text)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert chunks[1]["choices"][0]["delta"] == {"content": "b"}
    assert chunks[1]["choices"][0]["finish_reason"] == "length"
    assert chunks[2]["usage"]["completion_tokens"] == 2
    assert sse_events(response.text)[-1] == "[DONE]"


# -- models, health, tokenize -----------------------------------------------------------


class BosTokenizer(FakeTokenizer):
    """Adds a BOS (id 1) when asked to add special tokens."""

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + super().encode(text)


async def test_tokenize_adds_special_tokens_as_the_generation_endpoints_do() -> None:
    engine = FakeEngine()
    engine.tokenizer = BosTokenizer()
    conversation = {"messages": [{"role": "user", "content": "x"}]}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            answers = [(await post(url, "/tokenize", body)).json()["tokens"] for body in (
                {"prompt": "ab"}, {"prompt": "ab", "add_special_tokens": False},
                conversation, {**conversation, "add_special_tokens": True})]
    rendered = FakeTokenizer().encode("<user>x<assistant>")
    assert answers == [[1, 97, 98], [97, 98], rendered, [1, *rendered]]


async def test_models_health_tokenize_detokenize() -> None:
    engine = FakeEngine(served_model_name="served")
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            models = (await get(url, "/v1/models")).json()
            health = await get(url, "/health")
            tokens = (await post(url, "/tokenize",
                                 {"prompt": "ab", "return_token_strs": True})).json()
            chat_tokens = (await post(url, "/tokenize",
                                      {"messages": [{"role": "user", "content": "x"}]})).json()
            text = (await post(url, "/detokenize", {"tokens": [104, 105]})).json()
            by_served_name = await post(url, "/v1/completions",
                                        {"model": "served", "prompt": "x", "max_tokens": 1})
    assert models["object"] == "list"
    assert [card["id"] for card in models["data"]] == ["served"]
    assert models["data"][0]["max_model_len"] == 64
    assert models["data"][0]["vocab_size"] == 256
    assert health.status_code == 200
    assert tokens == {"count": 2, "max_model_len": 64, "tokens": [97, 98], "token_strs": ["a", "b"]}
    assert chat_tokens["tokens"] == FakeEngine().tokenizer.encode("<user>x<assistant>")
    assert text == {"prompt": "hi"}
    assert by_served_name.json()["model"] == "served"


# -- connections ------------------------------------------------------------------------


@pytest.fixture
def mock_clock_at_real_rate() -> trio.testing.MockClock:
    """Time passes as it does, and a test may jump it (pytest-trio runs the test on it)."""
    return trio.testing.MockClock(rate=1.0)


async def keep_alive_request(stream: trio.SocketStream, host: str) -> bytes:
    """GET /health on an open connection; the response head and body (by its length)."""
    await stream.send_all(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    received = b""
    while b"\r\n\r\n" not in received:
        data = await stream.receive_some(65536)
        assert data, "the server closed the kept-alive connection"
        received += data
    head, body = received.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection in the middle of a response"
        body += data
    return head


async def test_an_idle_connection_outlives_the_clients_keep_alive(
        mock_clock_at_real_rate: trio.testing.MockClock) -> None:
    """A client's pool reuses a connection idle for up to its expiry (httpx: 5 s);
    a server that closes sooner or at the same moment fails the request sent on it.
    Hypercorn's own default is those same 5 s: about 1% of requests failed so under
    load. The server keeps an idle connection longer, and still closes it in the end."""
    clock = mock_clock_at_real_rate
    client_expiry = httpx.Limits().keepalive_expiry
    assert client_expiry is not None and KEEP_ALIVE_SECONDS > 2 * client_expiry
    with trio.fail_after(TIMEOUT + 2 * KEEP_ALIVE_SECONDS):
        async with running_server(FakeEngine()) as url:
            host, port = host_port(url)
            async with await trio.open_tcp_stream(host, port) as stream:
                assert b" 200 " in await keep_alive_request(stream, host)
                await trio.testing.wait_all_tasks_blocked()
                clock.jump(2 * client_expiry)  # idle, as in a pool
                await trio.testing.wait_all_tasks_blocked()
                assert b" 200 " in await keep_alive_request(stream, host)
                await trio.testing.wait_all_tasks_blocked()
                clock.jump(KEEP_ALIVE_SECONDS + 1)
                await trio.testing.wait_all_tasks_blocked()
                assert await stream.receive_some(65536) == b""  # closed by the server


def test_hypercorn_keeps_the_listen_backlog_and_the_keep_alive_we_chose() -> None:
    """Hypercorn calls listen() again, with its own backlog (100), even on a socket
    it is handed (an API server's): 256 connections at once would overflow it."""
    for listen_fd in (None, 7):
        hyper = hypercorn_config(ServerConfig(), listen_fd=listen_fd)
        assert hyper.backlog == LISTEN_BACKLOG >= 1024
        assert hyper.keep_alive_timeout == KEEP_ALIVE_SECONDS


# -- errors -------------------------------------------------------------------------------

BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": {"text": "x"}}, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["a", 3]}, "prompt[1]"),
    ("/v1/completions", {"prompt": ["a"] * 257}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 100}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, "logit_bias[...]"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"prompt": "x" * 100}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user",
                                            "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [999]}, "tokens"),
]


@pytest.mark.parametrize("stream", [False, True])
async def test_bad_requests_get_400_naming_the_field(stream: bool) -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            for path, body, param in BAD_REQUESTS:
                if stream and path.startswith("/v1") and "stream_options" not in body:
                    body = {**body, "stream": True}
                response = await post(url, path, body)
                assert response.status_code == 400, (body, response.text)
                error = error_of(response)
                assert (error["param"], error["type"]) == (param, "invalid_request_error"), body
            # Bad input disturbed nothing: the next good request is served.
            good = await post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert good.json()["choices"][0]["text"] == "ab"
    assert engine.running == set()


async def test_malformed_json_is_a_400() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine()) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                response = await client.post("/v1/completions", content=b"{not json",
                                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "JSON" in error_of(response)["message"]


async def test_unknown_route_wrong_method_and_large_body() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(), max_body_bytes=1000) as url:
            missing = await get(url, "/v1/nothing")
            wrong_method = await get(url, "/v1/completions")
            too_large = await post(url, "/v1/completions", {"prompt": "x" * 2000})
    assert missing.status_code == 404
    assert error_of(missing)["type"] == "not_found_error"
    assert wrong_method.status_code == 405
    assert "POST" in wrong_method.headers["Allow"]
    error_of(wrong_method)
    assert too_large.status_code == 413
    error_of(too_large)


async def test_api_key_guards_everything_but_health_and_metrics() -> None:
    engine = FakeEngine()
    body = {"prompt": "x", "max_tokens": 1}
    with trio.fail_after(TIMEOUT):
        async with running_server(engine, api_key="sesame") as url:
            missing = await post(url, "/v1/completions", body)
            wrong = await post(url, "/v1/completions", body,
                               headers={"Authorization": "Bearer sesame2"})
            models = await get(url, "/v1/models")
            right = await post(url, "/v1/completions", body,
                               headers={"Authorization": "Bearer sesame"})
            health = await get(url, "/health")
            metrics = await get(url, "/metrics")
    for response in (missing, wrong, models):
        assert response.status_code == 401
        assert error_of(response)["type"] == "authentication_error"
    assert right.status_code == 200
    assert (health.status_code, metrics.status_code) == (200, 200)
    assert len(engine.submitted) == 1


async def test_queue_full_is_a_503_with_retry_after() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(queue_full=True)) as url:
            plain = await post(url, "/v1/completions", {"prompt": "x"})
            streamed = await post(url, "/v1/completions", {"prompt": "x", "stream": True})
    for response in (plain, streamed):
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
        assert "queue" in error_of(response)["message"]


async def test_draining_engine_answers_503_and_health_turns_503() -> None:
    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            engine.begin_drain()
            health = await get(url, "/health")
            response = await post(url, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": "x"}]})
    assert health.status_code == 503
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"


async def test_failure_after_the_stream_started_sends_an_error_event_then_done() -> None:
    engine = FakeEngine(fail_after_tokens=2)
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url:
            response = await post(url, "/v1/completions",
                                  {"prompt": "x", "max_tokens": 5, "stream": True})
    assert response.status_code == 200
    events = sse_events(response.text)
    chunks = sse_json(response.text)
    assert [chunk["choices"][0]["text"] for chunk in chunks[:2]] == ["a", "b"]
    assert chunks[2]["error"]["code"] == 503
    assert "died" in chunks[2]["error"]["message"]
    assert events[-1] == "[DONE]"


async def test_failure_of_a_plain_request_is_a_503() -> None:
    with trio.fail_after(TIMEOUT):
        async with running_server(FakeEngine(fail_after_tokens=1)) as url:
            response = await post(url, "/v1/completions", {"prompt": "x", "max_tokens": 5})
    assert response.status_code == 503
    error_of(response)


async def test_models_retrieve_answers_for_the_served_model_only() -> None:
    """GET /v1/models/{id}, as the openai SDK's models.retrieve() asks it."""
    import openai
    from test_http_support import openai_clients

    engine = FakeEngine(served_model_name="org/served")
    with trio.fail_after(TIMEOUT):
        async with running_server(engine) as url, openai_clients(url) as (client, _):
            served = await client.models.retrieve("org/served")
            by_root = await client.models.retrieve("fake-model")
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("other")
    assert (served.id, served.object, by_root.id) == ("org/served", "model", "org/served")
    assert "does not exist" in str(missing.value)


# -- the command line -----------------------------------------------------------------


def test_serve_flags_fill_the_server_config() -> None:
    from trio_llm.api.cli import _build_parser, engine_config_from_args, server_config_from_args

    parser = _build_parser()
    assert server_config_from_args(parser.parse_args(["serve"])) == ServerConfig()
    args = parser.parse_args(["serve", "--served-model-name", "named", "--port", "0",
                              "--api-key", "k", "--shutdown-grace-seconds", "2"])
    config = server_config_from_args(args)
    assert (config.port, config.api_key) == (0, "k")
    # what the engine holds has one owner, EngineConfig
    engine_config = engine_config_from_args(args)
    assert (engine_config.served_model_name, engine_config.shutdown_grace_seconds) == (
        "named", 2.0)
    with pytest.raises(SystemExit, match="port"):
        server_config_from_args(parser.parse_args(["serve", "--port", "70000"]))


def test_the_default_api_server_count_follows_the_cpu_cores() -> None:
    """One API server per four cores, at least one, at most four (docs/performance.md,
    "Process layouts": the 2-core machine and the 16-core H200 machine); the flag,
    0 included, overrides it."""
    from trio_llm.api.cli import _build_parser, default_api_server_count

    assert [default_api_server_count(n) for n in (1, 2, 4, 7, 8, 16, 128)] == [
        1, 1, 1, 1, 2, 4, 4]
    parser = _build_parser()
    assert parser.parse_args(["serve"]).api_server_count is None
    assert parser.parse_args(["serve", "--api-server-count", "0"]).api_server_count == 0


# -- metrics --------------------------------------------------------------------------


def test_request_timer_spreads_a_coalesced_output_over_its_tokens() -> None:
    from trio_llm.api.metrics import ServerMetrics

    metrics = ServerMetrics("fake-model", max_model_len=100)
    timer = metrics.timer(10.0)
    timer.on_output(10.5, num_new_tokens=0, queue_time=0.25)
    timer.on_output(11.0, num_new_tokens=1, queue_time=None)
    timer.on_output(13.0, num_new_tokens=4, queue_time=None)
    timer.on_finish(13.0, "length", num_prompt_tokens=7, num_output_tokens=5)

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(
            name, {"model_name": "fake-model", "engine": "0", **labels})

    assert sample("vllm:request_queue_time_seconds_sum") == 0.25
    assert sample("vllm:time_to_first_token_seconds_sum") == 1.0
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert sample(f"{name}_count") == 4
        assert sample(f"{name}_sum") == 2.0
    assert sample("vllm:e2e_request_latency_seconds_sum") == 3.0
    assert sample("vllm:request_prompt_tokens_sum") == 7
    assert sample("vllm:request_generation_tokens_bucket", le="5.0") == 1
    assert sample("vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert sample("vllm:request_success_total", finished_reason="length") == 1


def test_token_count_buckets_are_vllms_1_2_5_series() -> None:
    from trio_llm.api.metrics import token_count_buckets

    assert token_count_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_count_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


async def test_version_ping_and_endpoints_not_served() -> None:
    from importlib.metadata import version

    engine = FakeEngine()
    with trio.fail_after(TIMEOUT):
        async with running_server(engine, api_key="secret") as url:
            served_version = await get(url, "/version")
            pings = [await get(url, "/ping"), await post(url, "/ping", {})]
            moderations = await post(url, "/v1/moderations", {"input": "x"},
                                     headers={"Authorization": "Bearer secret"})
            embeddings = await post(url, "/v1/embeddings", {"input": "x"},
                                    headers={"Authorization": "Bearer secret"})
            speech = await post(url, "/v1/audio/speech", {"input": "x"},
                                headers={"Authorization": "Bearer secret"})
            unknown = await get(url, "/v1/nothing-here", headers={"Authorization": "Bearer secret"})
    assert served_version.status_code == 200
    assert served_version.json() == {"version": version("trio-llm")}
    assert [ping.status_code for ping in pings] == [200, 200]  # open, like /health
    for response, path in ((moderations, "/v1/moderations"), (speech, "/v1/audio/speech")):
        assert response.status_code == 404
        assert f"{path} is not supported by trio-llm" in error_of(response)["message"]
    # served, but only by a model run as an embedding model: how to serve one
    assert embeddings.status_code == 400
    assert "--runner pooling" in error_of(embeddings)["message"]
    assert unknown.status_code == 404
    assert "not supported by trio-llm" not in error_of(unknown)["message"]
