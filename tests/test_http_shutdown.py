"""Graceful stop: the engine drains while the socket still answers (503s),
open requests finish within the grace period, the rest are cancelled; and the
`trio-llm serve` process exits 0 on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from functools import partial

import httpx
import trio
from test_http_support import FakeEngine, open_raw_request, receive_until, wait_until

from trio_llm.api.server import ServerConfig, serve_app

TIMEOUT = 10


async def test_a_drain_lets_open_requests_finish_and_refuses_new_ones() -> None:
    engine = FakeEngine(gated=True)
    trigger = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_app, engine,
                                              ServerConfig(port=0, shutdown_grace_seconds=30),
                                              shutdown_trigger=trigger.wait))
            connection = await open_raw_request(
                url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
            engine.allow_steps(1)
            await receive_until(connection, b'"text":"a"')
            trigger.set()
            await wait_until(lambda: not engine.is_healthy)
            async with httpx.AsyncClient(base_url=url) as client:
                health = await client.get("/health")
                refused = await client.post("/v1/completions", json={"prompt": "x"})
            engine.ungate()
            rest = await receive_until(connection, b"data: [DONE]")
            await connection.aclose()
        # serve_app returned by itself once the open request finished.
    assert (health.status_code, refused.status_code) == (503, 503)
    assert refused.headers["Retry-After"] == "1"
    assert b'"finish_reason":"length"' in rest
    assert engine.aborted == []
    assert len(engine.finished) == 1


async def test_a_drain_gives_up_after_the_grace_period() -> None:
    grace = 0.3  # real time: the fake clock would also fire the server's socket timeouts
    engine = FakeEngine(gated=True)
    trigger = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_app, engine,
                                              ServerConfig(port=0, shutdown_grace_seconds=grace),
                                              shutdown_trigger=trigger.wait))
            connection = await open_raw_request(
                url, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True})
            await wait_until(lambda: bool(engine.running))
            start = trio.current_time()
            trigger.set()
        # serve_app returned: the stream that never finished was cancelled.
        elapsed = trio.current_time() - start
        await connection.aclose()
    assert grace <= elapsed < grace + 2
    assert len(engine.aborted) == 1


async def test_serve_command_exits_0_after_sigterm_and_finishes_open_streams() -> None:
    command = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
               "--port", "0", "--num-kv-blocks", "64", "--max-model-len", "256",
               "--shutdown-grace-seconds", "60"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with trio.fail_after(120):
        process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, env=env)
        try:
            assert process.stderr is not None
            log = await _read_until(process.stderr, rb"serving 'tiny' at (http://\S+)")
            url = _logged_url(log)
            connection = await open_raw_request(url, "/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True,
                "stream": True})
            await receive_until(connection, b'"text"')
            process.send_signal(signal.SIGTERM)
            rest = await receive_until(connection, b"data: [DONE]")
            await connection.aclose()
            assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    assert b'"finish_reason":"length"' in rest


def _logged_url(log: bytes) -> str:
    match = re.search(rb"serving 'tiny' at (http://\S+)", log)
    assert match is not None
    return match.group(1).decode()


async def _read_until(stream: trio.abc.ReceiveStream, pattern: bytes) -> bytes:
    received = b""
    while not re.search(pattern, received):
        data = await stream.receive_some(4096)
        assert data, f"the server exited before logging {pattern!r}: {received.decode()}"
        received += data
    return received
