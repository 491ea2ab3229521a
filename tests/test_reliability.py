"""The reliability suite: the real tiny engine behind the real server on a
loopback port, under clients that misbehave. Afterwards nothing leaks (0
running, 0 waiting, every KV block free) and a fresh greedy request returns
exactly what it returned before.

Bounded in count and time (docs/reliability.md gives the figures): a few
hundred connections, one engine per test, a hard ``fail_after`` on each.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
import trio
from test_http_support import host_port, running_server
from trio.testing import wait_all_tasks_blocked

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.detokenizer import Detokenizer
from trio_llm.actors.errors import EngineDead
from trio_llm.actors.intake import Intake
from trio_llm.actors.queue import WaitingQueue
from trio_llm.actors.scheduler import Scheduler
from trio_llm.api.engine import Engine
from trio_llm.api.serving import EXIT_FORCED
from trio_llm.gpu.executor import ModelExecutor

CONFIG = EngineConfig(model="tiny", num_kv_blocks=256, block_size=16, max_num_seqs=32,
                      max_num_batched_tokens=512, max_model_len=512)
NUM_STORM_CLIENTS = 240
NUM_CONCURRENT_CLIENTS = 60
NUM_WITNESSES = 8
TIMEOUT = 120


def greedy_request(index: int, max_tokens: int, **fields: Any) -> dict[str, Any]:
    prompt = [(index * 31 + offset) % 1900 + 3 for offset in range(4 + index % 9)]
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **fields}


async def completion_text(client: httpx.AsyncClient, request: dict[str, Any]) -> str:
    response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


async def streamed_text(client: httpx.AsyncClient, request: dict[str, Any]) -> str:
    """The text of a streamed completion, read to its [DONE]."""
    parts = []
    async with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


async def wait_for_engine(predicate: Callable[[], bool]) -> None:
    """Let the engine run until ``predicate`` holds. The runner steps in a
    worker thread, during which every task is blocked: each round waits for a
    millisecond of that, so the loop does not spin against the runner for the
    GIL. The test's ``fail_after`` bounds it."""
    while not predicate():
        await wait_all_tasks_blocked(cushion=0.001)


async def assert_nothing_leaked(engine: Engine, client: httpx.AsyncClient,
                                reference: dict[int, str]) -> None:
    """Every handler has ended; then a fresh request (channels are FIFO: every
    abort sent before it was handled once it finishes) repeats its reference
    exactly, and the engine holds nothing."""
    await wait_for_engine(lambda: engine.num_open_requests == 0)
    assert await completion_text(client, greedy_request(0, 24)) == reference[0]
    stats = engine.statistics()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


async def references(client: httpx.AsyncClient) -> dict[int, str]:
    return {index: await completion_text(client, greedy_request(index, 24))
            for index in range(NUM_WITNESSES)}


# -- a disconnect storm -------------------------------------------------------------------


async def open_connection(url: str, *, receive_buffer: int | None = None) -> trio.SocketStream:
    host, port = host_port(url)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


def request_bytes(request: dict[str, Any]) -> tuple[bytes, bytes]:
    body = json.dumps(request).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head, body


async def receive_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        data = await stream.receive_some(65536)
        if not data:
            return received  # the request finished first: a hang-up after the end
        received += data
    return received


async def hang_up(url: str, index: int, rng: random.Random) -> str:
    """One client that goes away at a random point; returns where."""
    streamed = rng.random() < 0.8
    head, body = request_bytes(greedy_request(index, rng.randint(8, 64), stream=streamed))
    stream = await open_connection(url)
    point = rng.choice(["in the body", "before the first byte", "mid-stream",
                        "before [DONE]"] if streamed else ["in the body", "before the answer"])
    try:
        if point == "in the body":
            await stream.send_all(head + body[:rng.randint(0, len(body) - 1)])
        else:
            await stream.send_all(head + body)
        if point == "mid-stream":
            for _ in range(rng.randint(1, 6)):
                await receive_until(stream, b"\n\n")
        elif point == "before [DONE]":
            await receive_until(stream, b'"finish_reason":"length"')
    finally:
        await stream.aclose()
    return point


async def test_a_disconnect_storm_leaves_nothing_behind() -> None:
    rng = random.Random(11)
    points: list[str] = []
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine, running_server(engine) as url, \
                httpx.AsyncClient(base_url=url, timeout=60) as client:
            reference = await references(client)
            limiter = trio.CapacityLimiter(NUM_CONCURRENT_CLIENTS)
            witnessed: dict[int, str] = {}

            async def storm_client(index: int) -> None:
                async with limiter:
                    points.append(await hang_up(url, index, rng))

            async def witness(index: int) -> None:
                witnessed[index] = await streamed_text(client, greedy_request(index, 24))

            async with trio.open_nursery() as nursery:
                for index in range(NUM_STORM_CLIENTS):
                    nursery.start_soon(storm_client, index)
                for index in range(NUM_WITNESSES):
                    nursery.start_soon(witness, index)
            assert witnessed == reference
            await assert_nothing_leaked(engine, client, reference)
    assert len(points) == NUM_STORM_CLIENTS
    assert {"in the body", "before the first byte", "mid-stream", "before [DONE]",
            "before the answer"} == set(points)


async def test_slow_readers_that_stop_reading_stall_no_one() -> None:
    with trio.fail_after(TIMEOUT):
        async with Engine.open(CONFIG) as engine, running_server(engine) as url, \
                httpx.AsyncClient(base_url=url, timeout=60) as client:
            reference = await references(client)
            # Long streams with 20 logprobs a token: far more than a 4 KiB
            # receive buffer holds, so the server's sends block.
            readers: list[trio.SocketStream] = []
            try:
                for index in range(6):
                    stream = await open_connection(url, receive_buffer=4096)
                    readers.append(stream)
                    head, body = request_bytes(greedy_request(index, 300, stream=True,
                                                              logprobs=20))
                    await stream.send_all(head + body)
                    await receive_until(stream, b"data: ")
                witnessed = {}
                async with trio.open_nursery() as nursery:
                    for index in range(NUM_WITNESSES):
                        async def witness(index: int = index) -> None:
                            witnessed[index] = await streamed_text(client,
                                                                   greedy_request(index, 24))
                        nursery.start_soon(witness)
                assert witnessed == reference
                # The engine finished the slow readers' requests; their handlers
                # are still stuck sending (their output waits, coalesced).
                await wait_for_engine(lambda: engine.statistics().num_running == 0)
                assert engine.num_open_requests == len(readers)
            finally:
                # Before the server stops: Hypercorn's sends are shielded, so a
                # connection whose client never reads cannot be cancelled
                # (docs/reliability.md, "Not solved").
                for stream in readers:
                    await stream.aclose()
            await assert_nothing_leaked(engine, client, reference)


# -- overload ---------------------------------------------------------------------------


async def test_overload_against_a_small_waiting_queue_gets_503s_and_exact_answers() -> None:
    config = EngineConfig(model="tiny", num_kv_blocks=256, block_size=16, max_num_seqs=2,
                          max_waiting_requests=4, max_model_len=512)
    num_requests = 48
    statuses: list[int] = []
    max_waiting_seen = 0
    with trio.fail_after(TIMEOUT):
        async with Engine.open(config) as engine, running_server(engine) as url, \
                httpx.AsyncClient(base_url=url, timeout=60) as client:
            reference = await references(client)

            async def request(index: int) -> None:
                nonlocal max_waiting_seen
                response = await client.post("/v1/completions",
                                             json=greedy_request(index % NUM_WITNESSES, 24))
                max_waiting_seen = max(max_waiting_seen, engine.statistics().num_waiting)
                statuses.append(response.status_code)
                if response.status_code == 503:
                    assert response.headers["Retry-After"] == "1"
                    assert response.json()["error"]["type"] == "service_unavailable"
                else:
                    assert response.json()["choices"][0]["text"] == reference[index % 8]

            async with trio.open_nursery() as nursery:
                for index in range(num_requests):
                    nursery.start_soon(request, index)
            await assert_nothing_leaked(engine, client, reference)
    assert set(statuses) == {200, 503}
    assert statuses.count(200) >= 2 + 4  # the seats and the queue were used
    assert max_waiting_seen <= 4


# -- a fault in each actor ------------------------------------------------------------------


def fail_after_calls(owner: type, name: str, num_calls: int) -> Callable[..., Any]:
    original = getattr(owner, name)
    calls = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > num_calls:
            raise RuntimeError(f"injected fault in {owner.__name__}.{name}")
        return original(*args, **kwargs)

    return failing


ACTOR_FAULTS = {
    "intake": (Intake, "admit", 4),
    "queue": (WaitingQueue, "admit", 4),
    "scheduler": (Scheduler, "schedule", 12),
    "runner": (ModelExecutor, "execute", 12),
    "detokenizer": (Detokenizer, "process", 12),
}


@pytest.mark.parametrize("actor", list(ACTOR_FAULTS))
async def test_a_fault_in_any_actor_fails_every_request_loudly_and_hangs_nothing(
        monkeypatch: pytest.MonkeyPatch, actor: str) -> None:
    owner, name, num_calls = ACTOR_FAULTS[actor]
    monkeypatch.setattr(owner, name, fail_after_calls(owner, name, num_calls))
    outcomes: list[str] = []
    with trio.fail_after(TIMEOUT), pytest.raises(EngineDead, match="injected fault"):
        async with Engine.open(CONFIG) as engine, running_server(engine) as url, \
                httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def request(index: int) -> None:
                try:
                    response = await client.post("/v1/completions",
                                                 json=greedy_request(index, 40))
                    outcomes.append(str(response.status_code))
                except httpx.HTTPError as error:
                    outcomes.append(type(error).__name__)

            async with trio.open_nursery() as nursery:
                for index in range(12):
                    nursery.start_soon(request, index)
            health = await client.get("/health")
            refused = await client.post("/v1/completions", json=greedy_request(0, 4))
            assert not engine.is_healthy
    assert "503" in outcomes  # the requests open when it died got EngineDead
    assert set(outcomes) <= {"200", "503"}
    assert (health.status_code, refused.status_code) == (503, 503)


# -- signals under load -------------------------------------------------------------------

# One process: these tests signal the server itself (test_http_shutdown.py drains
# the served layout on SIGTERM too).
SERVE_COMMAND = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
                 "--port", "0", "--num-kv-blocks", "256", "--max-model-len", "512",
                 "--shutdown-grace-seconds", "60", "--api-server-count", "0"]


async def serving_process(nursery: trio.Nursery) -> tuple[trio.Process, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await trio.lowlevel.open_process(SERVE_COMMAND, stderr=subprocess.PIPE, env=env)
    assert process.stderr is not None
    log = b""
    while not (match := re.search(rb"serving 'tiny' at (http://\S+)", log)):
        data = await process.stderr.receive_some(4096)
        assert data, f"the server exited early: {log.decode()}"
        log += data
    nursery.start_soon(drain, process.stderr)
    return process, match.group(1).decode()


async def drain(stream: trio.abc.ReceiveStream) -> None:
    while await stream.receive_some(65536):
        pass


async def open_streams(url: str, num_streams: int, max_tokens: int) -> list[trio.SocketStream]:
    streams = []
    for index in range(num_streams):
        stream = await open_connection(url)
        head, body = request_bytes(greedy_request(index, max_tokens, stream=True))
        await stream.send_all(head + body)
        await receive_until(stream, b"data: ")
        streams.append(stream)
    return streams


async def run_signals_test(body: Callable[[trio.Process, str], Awaitable[None]]) -> None:
    async with trio.open_nursery() as nursery:
        process, url = await serving_process(nursery)
        try:
            await body(process, url)
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()


async def test_sigterm_under_load_finishes_every_open_stream_and_exits_0() -> None:
    async def body(process: trio.Process, url: str) -> None:
        streams = await open_streams(url, 16, 48)
        process.send_signal(signal.SIGTERM)
        rests = [await receive_until(stream, b"data: [DONE]") for stream in streams]
        assert all(b'"finish_reason":"length"' in rest for rest in rests)
        assert await process.wait() == 0

    with trio.fail_after(TIMEOUT):
        await run_signals_test(body)


async def test_a_second_sigint_under_load_stops_at_once() -> None:
    async def body(process: trio.Process, url: str) -> None:
        streams = await open_streams(url, 16, 400)
        process.send_signal(signal.SIGINT)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/health")).status_code == 503  # draining
        process.send_signal(signal.SIGINT)
        # Well inside the 60 s grace: the open streams are cut, not waited for.
        with trio.fail_after(20):
            returncode = await process.wait()
            ends = [await receive_until(stream, b"data: [DONE]") for stream in streams]
        assert returncode == 0
        assert not any(b'"finish_reason":"length"' in end for end in ends)

    with trio.fail_after(TIMEOUT):
        await run_signals_test(body)


async def test_a_second_signal_ends_a_server_held_by_clients_that_stop_reading() -> None:
    """Hypercorn's sends cannot be cancelled: without the forced exit a client that
    never reads kept the stopped server alive for ever."""
    async def body(process: trio.Process, url: str) -> None:
        readers = []
        for index in range(3):  # 20 logprobs a token: far beyond a 4 KiB receive buffer
            stream = await open_connection(url, receive_buffer=4096)
            head, body = request_bytes(greedy_request(index, 400, stream=True, logprobs=20))
            await stream.send_all(head + body)
            await receive_until(stream, b"data: ")
            readers.append(stream)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            # Once the engine is done, all that is left of the readers' requests
            # is their handlers' blocked sends.
            while "vllm:num_requests_running{" not in (text := (
                    await client.get("/metrics")).text) or not re.search(
                    r'^vllm:num_requests_running\{[^}]*\} 0\.0$', text, re.MULTILINE):
                await trio.lowlevel.checkpoint()
        process.send_signal(signal.SIGTERM)
        process.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            returncode = await process.wait()
        assert returncode == EXIT_FORCED, returncode
        for stream in readers:
            await stream.aclose()

    with trio.fail_after(TIMEOUT):
        await run_signals_test(body)
