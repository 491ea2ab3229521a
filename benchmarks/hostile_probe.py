"""Replays issue 9's and issue 22's hostile requests against the tiny model and prints
what each cost.

    python benchmarks/hostile_probe.py            # the engine in this process
    python benchmarks/hostile_probe.py --served   # an engine core and one API server

One server on a loopback port (the real engine, in this process; with --served, the
served layout's core and front joined by a socket pair, as api/processes.py wires them). For each
attack: its answer, how long it took, the longest /health round trip and the
longest stall of the event loop while it ran, and the largest gap between
chunks of a stream running beside it. A figure, not a test: docs/reliability.md
quotes a run of it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trio_llm.actors.config import EngineConfig  # noqa: E402
from trio_llm.actors.detokenizer import StopStrings  # noqa: E402
from trio_llm.actors.intake import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS  # noqa: E402
from trio_llm.api.engine import Engine  # noqa: E402
from trio_llm.api.processes import open_served_layout  # noqa: E402
from trio_llm.api.server import ServerConfig  # noqa: E402
from trio_llm.api.serving import serve_app  # noqa: E402

CONFIG = EngineConfig(model="tiny", num_kv_blocks=512, max_model_len=2048)
LOOP_TICK_SECONDS = 0.001


class Watch:
    """The longest loop stall, /health round trip and gap between chunks of a
    side stream, while an attack runs."""

    def __init__(self) -> None:
        self.max_loop_stall = 0.0
        self.max_health = 0.0
        self.max_chunk_gap = 0.0

    async def loop_ticker(self) -> None:
        last = time.perf_counter()
        while True:
            await trio.sleep(LOOP_TICK_SECONDS)
            now = time.perf_counter()
            self.max_loop_stall = max(self.max_loop_stall, now - last - LOOP_TICK_SECONDS)
            last = now

    async def health(self, client: httpx.AsyncClient) -> None:
        while True:
            started = time.perf_counter()
            await client.get("/health")
            self.max_health = max(self.max_health, time.perf_counter() - started)
            await trio.sleep(0.05)

    async def side_stream(self, client: httpx.AsyncClient) -> None:
        request = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                   "stream": True, "temperature": 0}
        while True:
            async with client.stream("POST", "/v1/completions", json=request) as response:
                last = time.perf_counter()
                async for _ in response.aiter_lines():
                    now = time.perf_counter()
                    self.max_chunk_gap = max(self.max_chunk_gap, now - last)
                    last = now


async def watched(client: httpx.AsyncClient, attack: Callable[[], Awaitable[str]]
                  ) -> tuple[str, float, Watch]:
    watch = Watch()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.loop_ticker)
        nursery.start_soon(watch.health, client)
        nursery.start_soon(watch.side_stream, client)
        await trio.sleep(0.5)  # the side stream is streaming
        baseline_gap, watch.max_chunk_gap, watch.max_loop_stall = watch.max_chunk_gap, 0.0, 0.0
        watch.max_health = 0.0
        started = time.perf_counter()
        outcome = await attack()
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    watch.baseline_gap = baseline_gap  # type: ignore[attr-defined]
    return outcome, elapsed, watch


def status_of(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"][:70]
    except (ValueError, KeyError, TypeError):
        message = ""
    return f"{response.status_code} {message}".strip()


async def post(client: httpx.AsyncClient, body: Any, **kwargs: Any) -> str:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **kwargs.pop("headers", {})}
    return status_of(await client.post("/v1/completions", content=content, headers=headers,
                                       **kwargs))


async def oversized_then_next(url: str) -> str:
    """A 9 MB body on a kept-alive connection, then a second request on it."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    body = b'{"prompt": "' + b"x" * 9_000_000 + b'"}'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        await stream.send_all(head + body)
    except trio.BrokenResourceError:
        pass
    received = b""
    with trio.move_on_after(10):
        while b"}}" not in received:
            data = await stream.receive_some(65536)
            if not data:
                break
            received += data
    status = received.split(b"\r\n", 1)[0].decode()
    outcome = "hung"
    with trio.move_on_after(10):
        try:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = await stream.receive_some(65536)
            outcome = "closed by the server" if not data else data.split(b"\r\n", 1)[0].decode()
        except trio.BrokenResourceError:
            outcome = "closed by the server"
    await stream.aclose()
    return f"{status}; next request on the connection: {outcome}"


async def post_chat(client: httpx.AsyncClient, body: Any) -> str:
    return status_of(await client.post("/v1/chat/completions", json=body))


async def smuggled(url: str, framing: bytes) -> str:
    """A request with ambiguous framing and a second request hidden behind its body."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    body = b'{"prompt": "hi", "max_tokens": 1}'
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\n" + framing + b"\r\n"
                          + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
                          + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    received = b""
    with trio.move_on_after(10):
        while data := await stream.receive_some(65536):
            received += data
    await stream.aclose()
    status = received.split(b"\r\n", 1)[0].decode()
    return (f"{status}; responses: {received.count(b'HTTP/1.1 ')}; "
            f"{'closed' if b'connection: close' in received.lower() else 'kept open'}")


def tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": f"function_{i}", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"},
                                             "days": {"type": "integer"}},
            "required": ["city"]}}} for i in range(count)]


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def issue_22_attacks(client: httpx.AsyncClient, url: str
                     ) -> dict[str, Callable[[], Awaitable[str]]]:
    """Costs not proportional to a body's size: constraints, choices, framing."""
    chat = {"messages": [{"role": "user", "content": "call one"}], "max_tokens": 30}
    optional = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4}
                                                 for i in range(384)}}

    def constrained(constraint: dict[str, Any], max_tokens: int = 8) -> Callable[[], Any]:
        return lambda: post(client, {"prompt": "x", "max_tokens": max_tokens,
                                     "structured_outputs": constraint})

    async def bodies_of_7_mb() -> str:
        body = b'{"prompt": "' + b"x" * (7 * 2**20) + b'", "max_tokens": 4}'
        outcomes: list[str] = []
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                async def one() -> None:
                    outcomes.append(await post(client, body))
                nursery.start_soon(one)
        return f"8 x {outcomes[0][:60]}"

    return {
        "tool_choice required, 10,000 tools (2.4 MB)": lambda: post_chat(
            client, {**chat, "tools": tools(10_000), "tool_choice": "required"}),
        "tool_choice required, 128 tools (at the bound)": lambda: post_chat(
            client, {**chat, "tools": tools(128), "tool_choice": "required"}),
        "enum of 20,000 strings": constrained(
            {"json": {"enum": [f"value-{i}-of-the-enum" for i in range(20_000)]}}),
        "enum of 1,024 strings (at the limit)": constrained(
            {"json": {"enum": [f"value-{i}-of-the-enum" for i in range(1024)]}}),
        "schema nested 400 deep": constrained({"json": nested_schema(400)}),
        "schema nested 31 deep (at the limit)": constrained({"json": nested_schema(31)}),
        "384 optional properties (at the limit)": constrained({"json": optional}),
        "regex [a-z]{8}": constrained({"regex": "[a-z]{8}"}),
        "n 64 x 2 prompts, 200 tokens each": lambda: post(
            client, {"prompt": ["a", "b"], "n": 64, "max_tokens": 200, "ignore_eos": True}),
        "n 128 x 2 prompts, 200 tokens each (at --max-request-choices)": lambda: post(
            client, {"prompt": ["a", "b"], "n": 128, "max_tokens": 200, "ignore_eos": True}),
        "n 100 x 3 prompts (over --max-request-choices)": lambda: post(
            client, {"prompt": ["a", "b", "c"], "n": 100, "max_tokens": 200}),
        "8 concurrent 7 MB bodies (refused)": bodies_of_7_mb,
        "Content-Length and Transfer-Encoding, a request behind": lambda: smuggled(
            url, b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n"),
        "obs-folded Transfer-Encoding, a request behind": lambda: smuggled(
            url, b"Transfer-Encoding:\r\n chunked\r\n"),
    }


def attacks(client: httpx.AsyncClient, url: str) -> dict[str, Callable[[], Awaitable[str]]]:
    nested = b'{"prompt": "x", "junk": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    async def nothing() -> str:
        await trio.sleep(2)
        return "(no attack: the side stream and /health alone)"

    return {
        "nothing, for comparison": nothing,
        "stop string of 1,000,000 characters": lambda: post(
            client, {"prompt": "hi", "max_tokens": 2, "stop": "x" * 1_000_000}),
        "stop string of 40,000 characters": lambda: post(
            client, {"prompt": "hi", "max_tokens": 2, "stop": "x" * 40_000}),
        "10,000 stop strings": lambda: post(
            client, {"prompt": "hi", "max_tokens": 2, "stop": ["x"] * 10_000}),
        "no stop strings, 64 tokens": lambda: post(
            client, {"prompt": "hi", "max_tokens": 64, "ignore_eos": True}),
        "64 stop strings of 256 characters, 64 tokens": lambda: post(
            client, {"prompt": "hi", "max_tokens": 64, "ignore_eos": True,
                     "stop": [chr(65 + i % 26) * 255 + chr(97 + i // 26) for i in range(64)]}),
        "prompt of 7 MB (refused as too long)": lambda: post(
            client, {"prompt": "hello world " * 600_000, "max_tokens": 2}),
        "prompt of 90 kB (refused as too long)": lambda: post(
            client, {"prompt": "hello world " * 7_500, "max_tokens": 2}),
        "1,000 levels of JSON nesting": lambda: post(client, nested),
        "Content-Type: text/plain": lambda: post(
            client, {"prompt": "hi", "max_tokens": 2}, headers={"Content-Type": "text/plain"}),
        "9 MB body, then a second request on the connection": lambda: oversized_then_next(url),
        **issue_22_attacks(client, url),
    }


def microseconds_per_call(function: Callable[[], object], num_calls: int) -> float:
    started = time.perf_counter()
    for _ in range(num_calls):
        function()
    return (time.perf_counter() - started) / num_calls * 1e6


def print_stop_string_costs() -> None:
    """One step's matching at the bounds, against text built to fail every
    stop string late, and for three short stop strings."""
    length, count = MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
    worst = StopStrings(["a" * (length - 1) + chr(66 + index) for index in range(count)])
    text = "a" * (length - 2) + "c"
    common = StopStrings(["\n\n", "User:", "</s>"])
    short_text = "hello world, this is"
    print(f"stop strings, {count} of {length} characters, worst step: held-back check "
          f"{microseconds_per_call(lambda: worst.num_held_chars(text), 300):.0f} us, search "
          f"{microseconds_per_call(lambda: worst.find(text, length - 3), 300):.0f} us")
    print(f"stop strings, 3 short ones: held-back check "
          f"{microseconds_per_call(lambda: common.num_held_chars(short_text), 20000):.2f} us, "
          f"search {microseconds_per_call(lambda: common.find(short_text, 10), 20000):.2f} us")


@asynccontextmanager
async def open_engine(served: bool) -> AsyncIterator[Engine]:
    if not served:
        async with Engine.open(CONFIG) as engine:
            yield engine
        return
    async with open_served_layout(CONFIG, 1) as (front,):
        yield front


async def main() -> None:
    served = "--served" in sys.argv[1:]
    async with open_engine(served) as engine, trio.open_nursery() as nursery:
        url = await nursery.start(serve_app, engine, ServerConfig(port=0))
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            print("| attack | answer | time | longest /health | longest loop stall "
                  "| side stream's largest gap (before) |")
            print("|---|---|---|---|---|---|")
            for name, attack in attacks(client, url).items():
                outcome, elapsed, watch = await watched(client, attack)
                print(f"| {name} | {outcome} | {elapsed * 1000:.0f} ms "
                      f"| {watch.max_health * 1000:.0f} ms | {watch.max_loop_stall * 1000:.0f} ms "
                      f"| {watch.max_chunk_gap * 1000:.0f} ms "
                      f"({watch.baseline_gap * 1000:.0f} ms) |")  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()
    print_stop_string_costs()


if __name__ == "__main__":
    trio.run(main)
