"""The served layout as `trio-llm serve --api-server-count 2` runs it: an engine-core
process and two API-server processes behind one port. Outputs equal the
in-process engine's, metrics add up over the API servers, a dead API server's
requests are aborted while the other goes on, a dead core ends everything with
errors, and nothing is left running. (SIGTERM: tests/test_http_shutdown.py.)"""

from __future__ import annotations

import json
import os
import re
import signal

import httpx
import trio
from test_http_support import (
    ServeProcess,
    api_server_of,
    is_running,
    open_raw_request,
    receive_until,
    serve_process,
    sse_json,
)

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.messages import SamplingParams
from trio_llm.api.engine import Engine

# The engine the first test serves: `serve_process`'s --num-kv-blocks 64, and
# --max-model-len 512 for its long streams.
CONFIG = EngineConfig(model="tiny", num_kv_blocks=64, max_model_len=512)
LONG_STREAMS = ("--max-model-len", "512")
TIMEOUT = 150
PROMPTS = ["Once upon a time", "The little dog", "In the morning", "She said"]
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11},
             {"temperature": 0.8, "top_p": 0.9, "seed": 3}]
NUM_TOKENS = 10
CONNECTIONS_AT_ONCE = 4


def workload() -> list[dict[str, object]]:
    return [{"prompt": prompt, "max_tokens": NUM_TOKENS, "ignore_eos": True, **sampling}
            for prompt in PROMPTS for sampling in SAMPLINGS]


async def in_process_texts(requests: list[dict[str, object]]) -> list[str]:
    texts = []
    async with Engine.open(CONFIG) as engine:
        for request in requests:
            fields = {k: v for k, v in request.items() if k != "prompt"}
            params = SamplingParams(**fields)  # type: ignore[arg-type]
            texts.append("".join([out.text async for out in
                                  engine.generate(str(request["prompt"]), params)]))
    return texts


async def streamed(server: ServeProcess, request: dict[str, object]) -> tuple[str, str]:
    """One streamed completion on a fresh connection: (API server, text)."""
    connection = await open_raw_request(server.url, "/v1/completions",
                                        {**request, "stream": True})
    async with connection:
        body = await receive_until(connection, b"data: [DONE]")
        api_server = api_server_of(connection, server)
    events = sse_json(body.decode().split("\r\n\r\n", 1)[1])
    return api_server, "".join(event["choices"][0]["text"] for event in events)


async def metric(url: str, name: str) -> float:
    async with httpx.AsyncClient(base_url=url) as client:
        text = (await client.get("/metrics")).text
    match = re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} is not in /metrics"
    return float(match.group(2))


async def wait_metric(url: str, name: str, value: float) -> None:
    """Ask /metrics until ``name`` reads ``value`` (the engine core is another
    process: there is no task to wait for). A connection the kernel had queued
    for an API server that died is reset: that ask is just asked again."""
    while True:  # bounded by the test's fail_after: a loaded machine may need many asks
        try:
            if await metric(url, name) == value:
                return
        except httpx.TransportError:
            pass
        await trio.lowlevel.checkpoint()


async def open_stream_on(server: ServeProcess, api_server: str,
                         request: dict[str, object]) -> trio.SocketStream:
    """A streamed request on a connection ``api_server`` accepted. The API servers
    accept on one shared socket, whichever is free first: connections opened
    several at a time (each asking GET /version, which counts as no request)
    reach each of them; the request goes on the one that reached ``api_server``."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)

    async def open_one(connections: list[trio.SocketStream]) -> None:
        connection = await trio.open_tcp_stream(host, int(port))
        await connection.send_all(f"GET /version HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        await receive_until(connection, b'"}')  # answered: its server is known
        connections.append(connection)

    for _ in range(32):
        connections: list[trio.SocketStream] = []
        async with trio.open_nursery() as nursery:
            for _ in range(CONNECTIONS_AT_ONCE):
                nursery.start_soon(open_one, connections)
        chosen = next((connection for connection in connections
                       if api_server_of(connection, server) == api_server), None)
        for connection in connections:
            if connection is not chosen:
                await connection.aclose()
        if chosen is not None:
            payload = json.dumps({**request, "stream": True}).encode()
            await chosen.send_all(
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                + payload)
            await receive_until(chosen, b'"text"')
            return chosen
    raise AssertionError(f"no connection landed on {api_server}")


async def test_two_api_servers_serve_the_in_process_outputs_and_survive_one_dying() -> None:
    requests = workload()
    with trio.fail_after(TIMEOUT):
        expected = await in_process_texts(requests)
        async with serve_process(*LONG_STREAMS, num_api_servers=2) as server:
            results = []
            async with trio.open_nursery() as nursery:
                async def run(index: int) -> None:
                    results.append((index, *await streamed(server, requests[index])))
                for index in range(len(requests)):
                    nursery.start_soon(run, index)
            # The kernel spreads connections at random: make sure both servers had some.
            num_extra = 0
            for api_server in {"api-server-0", "api-server-1"} - {r[1] for r in results}:
                connection = await open_stream_on(server, api_server, requests[0])
                await receive_until(connection, b"data: [DONE]")
                await connection.aclose()
                num_extra += 1
            num_finished = await metric(server.url, "vllm:request_success_total")

            # One long stream on each API server; then API server 1 dies. The streams
            # are long enough that neither ends before both run, however busy the
            # machine (200 tokens once did); both fit the 64 KV blocks of 16 tokens.
            long_request = {"prompt": "x", "max_tokens": 480, "ignore_eos": True}
            survivor = await open_stream_on(server, "api-server-0", long_request)
            doomed = await open_stream_on(server, "api-server-1", long_request)
            await wait_metric(server.url, "vllm:num_requests_running", 2)
            os.kill(server.pids["api-server-1"], signal.SIGKILL)
            # The core aborts the dead server's request; the other streams on.
            await wait_metric(server.url, "vllm:num_requests_running", 1)
            more = await receive_until(survivor, b'"text"')
            fine = await streamed(server, requests[0])
            await survivor.aclose()
            await doomed.aclose()
            await wait_metric(server.url, "vllm:num_requests_running", 0)
            kv_usage = await metric(server.url, "vllm:kv_cache_usage_perc")
            server.process.send_signal(signal.SIGTERM)
            exit_code = await server.process.wait()
            still_running = [name for name, pid in server.pids.items() if is_running(pid)]
    assert [text for _, _, text in sorted(results)] == expected
    # Whichever API server answered /metrics counted the other's requests too.
    assert num_finished == len(requests) + num_extra
    assert more
    assert fine == ("api-server-0", expected[0])
    assert kv_usage == 0.0
    assert exit_code == 1  # an API server died: not a clean stop
    assert still_running == []


async def test_a_dead_engine_core_ends_every_request_with_an_error_and_every_process() -> None:
    with trio.fail_after(TIMEOUT):
        # streams long enough that neither can end before the kill (as above)
        async with serve_process(*LONG_STREAMS, num_api_servers=2) as server:
            request = {"prompt": "x", "max_tokens": 480, "ignore_eos": True}
            streams = [await open_stream_on(server, f"api-server-{index}", request)
                       for index in range(2)]
            os.kill(server.pids["core"], signal.SIGKILL)
            rests = [await receive_until(stream, b"data: [DONE]") for stream in streams]
            for stream in streams:
                await stream.aclose()
            exit_code = await server.process.wait()
            await server.wait_for(rb"exit codes")
            still_running = [name for name, pid in server.pids.items() if is_running(pid)]
    for rest in rests:
        errors = [json.loads(line.removeprefix(b"data: ")) for line in rest.split(b"\n")
                  if line.startswith(b'data: {"error"')]
        assert errors and "engine core went away" in errors[0]["error"]["message"]
    assert exit_code == 1
    assert re.search(rb"API servers \[1, 1\]", server.log)
    assert still_running == []


async def wait_exited(pid: int) -> None:
    """Until process ``pid`` (not a child of ours) has ended: its pidfd turns readable."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


async def test_a_killed_supervisor_leaves_no_process_and_open_streams_finish() -> None:
    """However the supervisor dies, its children do not outlive it: each API server
    sees its lifeline end and stops as on SIGTERM (its open streams finish), and the
    engine core stops once every API server has gone."""
    with trio.fail_after(TIMEOUT):
        async with serve_process("--shutdown-grace-seconds", "60",
                                 num_api_servers=2) as server:
            request = {"prompt": "x", "max_tokens": 40, "ignore_eos": True}
            streams = [await open_stream_on(server, f"api-server-{index}", request)
                       for index in range(2)]
            os.kill(server.process.pid, signal.SIGKILL)
            await server.process.wait()
            rests = [await receive_until(stream, b"data: [DONE]") for stream in streams]
            for stream in streams:
                await stream.aclose()
            for pid in server.pids.values():
                await wait_exited(pid)
            await server.wait_for(rb"the supervisor is gone: stopping", count=2)
            still_running = [name for name, pid in server.pids.items() if is_running(pid)]
    assert all(b'"error"' not in rest for rest in rests)
    assert still_running == []


async def test_a_second_server_on_a_busy_port_fails_at_once_and_takes_no_connections() -> None:
    """One port, one server: the API servers share one listening socket (no
    SO_REUSEPORT), so a second `trio-llm serve` on the port exits non-zero with one
    line naming it, in either layout, and every answer comes from the first."""
    import sys

    with trio.fail_after(TIMEOUT):
        async with serve_process(num_api_servers=2) as server:
            port = server.url.rsplit(":", 1)[1]
            results = []
            for num_api_servers in (0, 2):
                command = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
                           "--port", port, "--served-model-name", "impostor",
                           "--api-server-count", str(num_api_servers)]
                results.append(await trio.run_process(command, capture_stderr=True,
                                                      check=False))
            async with httpx.AsyncClient(base_url=server.url) as client:
                names = [(await client.get("/v1/models")).json()["data"][0]["id"]
                         for _ in range(12)]
    for result in results:
        lines = result.stderr.decode().strip().splitlines()
        assert result.returncode != 0
        assert len(lines) == 1 and f"port {port}" in lines[0], lines
    assert set(names) == {"tiny"}


async def test_a_model_the_core_cannot_load_fails_in_one_line_in_either_layout() -> None:
    """A load-time error of the engine core (a KV cache that does not fit) ends
    `trio-llm serve` non-zero with the error on one line, no traceback, in the served
    layout (the core is a child process) as in-process."""
    import sys

    outputs = []
    with trio.fail_after(TIMEOUT):
        for num_api_servers in (0, 1):
            command = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
                       "--port", "0", "--cpu-kv-cache-gib", "0.0000001",
                       "--api-server-count", str(num_api_servers)]
            result = await trio.run_process(command, capture_stderr=True, check=False)
            assert result.returncode != 0
            outputs.append(result.stderr.decode())
    for output in outputs:
        assert "Traceback" not in output, output
        failures = [line for line in output.splitlines() if "ModelLoadError" in line]
        assert len(failures) == 1 and "no memory left for the KV cache" in failures[0], output


async def test_the_cores_counters_start_after_its_warm_up() -> None:
    """The served layout: the API server that warmed the engine core up zeroes its
    totals when done, so /metrics reads no tokens before the first request."""
    with trio.fail_after(TIMEOUT):
        async with serve_process(num_api_servers=1) as server:
            async with httpx.AsyncClient(base_url=server.url) as client:
                # ready once warmed up (it serves, 503, while warming)
                while (await client.get("/health")).status_code != 200:
                    await trio.lowlevel.checkpoint()
            before = [await metric(server.url, f"vllm:{name}_total")
                      for name in ("prompt_tokens", "generation_tokens",
                                   "prefix_cache_queries")]
            await streamed(server, {"prompt": [5, 6, 7, 8], "max_tokens": 3,
                                    "ignore_eos": True})
            prompt_tokens = await metric(server.url, "vllm:prompt_tokens_total")
    assert before == [0.0, 0.0, 0.0]
    assert prompt_tokens == 4.0
