"""Graceful stop: the engine drains while the socket still answers (503s),
open requests finish within the grace period, the rest are cancelled; and the
`trio-llm serve` process exits 0 on SIGTERM after its open streams finished, in
both layouts (one process; an engine core and two API servers)."""

from __future__ import annotations

import signal
from functools import partial

import httpx
import pytest
import trio
from test_http_support import (
    FakeEngine,
    is_running,
    open_raw_request,
    receive_until,
    serve_process,
    wait_until,
)

from trio_llm.api.server import ServerConfig
from trio_llm.api.serving import serve_app

TIMEOUT = 10


async def test_a_drain_lets_open_requests_finish_and_refuses_new_ones() -> None:
    engine = FakeEngine(gated=True, shutdown_grace_seconds=30)
    trigger = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_app, engine, ServerConfig(port=0),
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
    engine = FakeEngine(gated=True, shutdown_grace_seconds=grace)
    trigger = trio.Event()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            url = await nursery.start(partial(serve_app, engine, ServerConfig(port=0),
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


@pytest.mark.parametrize("num_api_servers", [0, 2])
async def test_serve_command_exits_0_after_sigterm_and_finishes_open_streams(
        num_api_servers: int) -> None:
    with trio.fail_after(120):
        async with serve_process("--shutdown-grace-seconds", "60",
                                 num_api_servers=num_api_servers) as server:
            connection = await open_raw_request(server.url, "/v1/completions", {
                "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True,
                "stream": True})
            await receive_until(connection, b'"text"')
            server.process.send_signal(signal.SIGTERM)
            rest = await receive_until(connection, b"data: [DONE]")
            await connection.aclose()
            exit_code = await server.process.wait()
            still_running = [name for name, pid in server.pids.items() if is_running(pid)]
    assert exit_code == 0, server.log.decode(errors="replace")
    assert b'"finish_reason":"length"' in rest
    assert still_running == []
    assert len(server.pids) == (num_api_servers + 1 if num_api_servers else 0)
