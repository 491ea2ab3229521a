"""Replays issue 9's hostile requests against the tiny model and prints what each cost.

    python benchmarks/hostile_probe.py

One server on a loopback port (the real engine, in this process). For each
attack: its answer, how long it took, the longest /health round trip and the
longest stall of the event loop while it ran, and the largest gap between
chunks of a stream running beside it. A figure, not a test: docs/reliability.md
quotes a run of it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from trio_llm.actors.config import EngineConfig  # noqa: E402
from trio_llm.actors.detokenizer import StopStrings  # noqa: E402
from trio_llm.actors.intake import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS  # noqa: E402
from trio_llm.api.engine import Engine  # noqa: E402
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


async def main() -> None:
    async with Engine.open(CONFIG) as engine, trio.open_nursery() as nursery:
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
