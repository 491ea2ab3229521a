"""Shared helpers of the HTTP tests (no tests here): a scripted engine, a server
on a free loopback port, a raw socket client and SSE parsing.

The fake engine has the Engine facade's interface and generates "abcd..." one
letter per step. With ``gated=True`` every step waits for ``allow_steps``, so
a test decides exactly how far generation has gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio
from trio.testing import wait_all_tasks_blocked

from trio_llm.actors.config import EngineConfig
from trio_llm.actors.errors import EngineDead, QueueFull, RequestRejected
from trio_llm.actors.generation_defaults import GenerationDefaults
from trio_llm.actors.messages import (
    ChatTemplateOptions,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)
from trio_llm.actors.supervisor import EngineStatistics
from trio_llm.api.server import ServerConfig
from trio_llm.api.serving import serve_app

NUM_FAKE_BLOCKS = 64
THREAD_SERVER_TIMEOUT = 60
BLOCKS_PER_REQUEST = 2


class FakeTokenizer:
    """One token per character (code point modulo 256)."""

    vocab_size = 256
    eos_token_ids = [0]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return [ord(char) % 256 for char in text]

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(chr(token_id) for token_id in token_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables: Any) -> str:
        names = "".join(f"<{name}>" for name in sorted(variables))
        turns = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return names + turns + ("<assistant>" if add_generation_prompt else "")


class FakeEngine:
    """The Engine facade's interface over a script (see the module docstring).

    ``fail_after_tokens`` makes a request fail with EngineDead after that many
    tokens; ``queue_full`` rejects every request as the queue would.
    """

    def __init__(self, *, max_model_len: int = 64, gated: bool = False,
                 fail_after_tokens: int | None = None, queue_full: bool = False,
                 shutdown_grace_seconds: float = 1.0,
                 served_model_name: str | None = None) -> None:
        self.config = EngineConfig(model="fake-model", served_model_name=served_model_name,
                                   shutdown_grace_seconds=shutdown_grace_seconds)
        self.model_name = served_model_name or "fake-model"
        self.max_model_len = max_model_len
        self.tokenizer = FakeTokenizer()
        self.generation_defaults = GenerationDefaults()
        self.pooling = None  # a generating engine: /v1/embeddings is refused
        self.running: set[str] = set()
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.submitted: list[dict[str, Any]] = []
        self.num_generated = 0
        self.max_num_running = 0
        self.fail_after_tokens = fail_after_tokens
        self.queue_full = queue_full
        self._num_steps_allowed: int | None = 0 if gated else None
        self._step_lot = trio.lowlevel.ParkingLot()
        self._ended_lot = trio.lowlevel.ParkingLot()
        self._draining = False
        self._num_prompt_tokens = 0

    # -- test controls ----------------------------------------------------------------

    def allow_steps(self, num_steps: int) -> None:
        assert self._num_steps_allowed is not None, "only a gated engine counts steps"
        self._num_steps_allowed += num_steps
        self._step_lot.unpark_all()

    def ungate(self) -> None:
        self._num_steps_allowed = None
        self._step_lot.unpark_all()

    # -- the facade's interface -------------------------------------------------------

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                 priority: int = 0, request_id: str | None = None,
                 cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = request_id or f"fake-{len(self.submitted)}"
        self.submitted.append({"prompt": prompt, "params": params or SamplingParams(),
                               "priority": priority, "request_id": request_id,
                               "cache_salt": cache_salt})
        return self._run(request_id, token_ids, params or SamplingParams())

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None, *,
             priority: int = 0, request_id: str | None = None,
             tools: list[dict[str, Any]] | None = None,
             documents: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             template_options: ChatTemplateOptions | None = None,
             cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        variables = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {}),
                     **({"documents": documents} if documents is not None else {})}
        options = template_options or ChatTemplateOptions()
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **variables)
        return self.generate(text, params, priority=priority, request_id=request_id,
                             cache_salt=cache_salt)

    def generate_many(self, prompts: list[tuple[str | list[int], SamplingParams]], *,
                      priority: int = 0, request_id: str | None = None,
                      cache_salt: str | None = None
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The children one after the other (the real engine interleaves them)."""
        base_id = request_id or f"fake-{len(self.submitted)}"
        return self._run_many([self.generate(prompt, params, priority=priority,
                                             request_id=f"{base_id}-{index}",
                                             cache_salt=cache_salt)
                               for index, (prompt, params) in enumerate(prompts)])

    def chat_many(self, messages: list[dict[str, Any]], params: list[SamplingParams], *,
                  priority: int = 0, request_id: str | None = None,
                  tools: list[dict[str, Any]] | None = None,
                  documents: list[dict[str, Any]] | None = None,
                  chat_template_kwargs: dict[str, Any] | None = None,
                  template_options: ChatTemplateOptions | None = None,
                  cache_salt: str | None = None) -> AsyncIterator[tuple[int, RequestOutput]]:
        variables = {**(chat_template_kwargs or {}), **({"tools": tools} if tools else {}),
                     **({"documents": documents} if documents is not None else {})}
        options = template_options or ChatTemplateOptions()
        prompt = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **variables)
        return self.generate_many([(prompt, choice) for choice in params], priority=priority,
                                  request_id=request_id, cache_salt=cache_salt)

    @staticmethod
    async def _run_many(children: list[AsyncIterator[RequestOutput]]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            for index, child in enumerate(children):
                async for output in child:
                    yield index, output
        finally:
            for child in children:
                aclose = getattr(child, "aclose", None)
                if aclose is not None:
                    with trio.CancelScope(shield=True):
                        await aclose()

    def _run(self, request_id: str, prompt_ids: list[int],
             params: SamplingParams) -> AsyncIterator[RequestOutput]:
        return FakeRequest(self, request_id, prompt_ids, params)

    def _check_admissible(self, prompt_ids: list[int]) -> None:
        if self._draining:
            raise EngineDead("the engine is shutting down")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestRejected(f"the prompt has {len(prompt_ids)} tokens, over "
                                  f"max_model_len {self.max_model_len}", param="prompt")
        if self.queue_full:
            raise QueueFull("the waiting queue is full")

    async def _wait_step(self) -> None:
        while self._num_steps_allowed is not None and self._num_steps_allowed <= 0:
            await self._step_lot.park()
        if self._num_steps_allowed is not None:
            self._num_steps_allowed -= 1
        await trio.lowlevel.checkpoint()

    def _output(self, request_id: str, index: int, num_prompt_tokens: int,
                params: SamplingParams, *, finished: bool) -> RequestOutput:
        self.num_generated += 1
        token_id = ord("a") + index % 26
        logprobs = None
        if params.logprobs is not None:
            top_ids = [token_id, token_id + 1][: params.logprobs]
            logprobs = [TokenLogprobs(logprob=-0.25, top_token_ids=top_ids,
                                      top_logprobs=[-0.25, -2.0][: len(top_ids)])]
        return RequestOutput(
            request_id=request_id, token_ids=[token_id], text=chr(token_id), logprobs=logprobs,
            finished=finished, finish_reason="length" if finished else None,
            num_prompt_tokens=num_prompt_tokens, num_output_tokens=index + 1,
            queue_time=0.0 if index == 0 else None,
        )

    async def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            num_running=len(self.running), num_waiting=0,
            num_free_blocks=NUM_FAKE_BLOCKS - BLOCKS_PER_REQUEST * len(self.running),
            num_total_blocks=NUM_FAKE_BLOCKS, num_preemptions=0, num_steps=self.num_generated,
            num_prompt_tokens=self._num_prompt_tokens, num_generation_tokens=self.num_generated,
        )

    async def fetch_statistics(self) -> EngineStatistics:
        await trio.lowlevel.checkpoint()
        return self.statistics()

    @property
    def num_open_requests(self) -> int:
        return len(self.running)

    @property
    def is_healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        return "the engine is shutting down" if self._draining else None

    def begin_drain(self) -> None:
        self._draining = True

    async def drain(self) -> None:
        """Like the facade's: refuse new requests, wait for the running ones up to
        the grace period (the server's stop then cancels what is left)."""
        self.begin_drain()
        with trio.move_on_after(self.config.shutdown_grace_seconds):
            while self.running:
                await self._ended_lot.park()

    async def wait_dead(self) -> None:
        await trio.sleep_forever()


class FakeRequest:
    """One request's output stream. Like the facade's, it aborts the request when
    closed early or cancelled; unlike an async generator, garbage collection
    never closes it, so a server that forgets to close a stream leaves the
    request running and the test sees it."""

    def __init__(self, engine: FakeEngine, request_id: str, prompt_ids: list[int],
                 params: SamplingParams) -> None:
        self._engine = engine
        self._request_id = request_id
        self._prompt_ids = prompt_ids
        self._params = params
        room = engine.max_model_len - len(prompt_ids)
        self._num_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self._index = -1
        self._ended = False

    def __aiter__(self) -> FakeRequest:
        return self

    async def __anext__(self) -> RequestOutput:
        engine = self._engine
        if self._ended:
            raise StopAsyncIteration
        if self._index < 0:
            engine._check_admissible(self._prompt_ids)
            engine.running.add(self._request_id)
            engine.max_num_running = max(engine.max_num_running, len(engine.running))
            engine._num_prompt_tokens += len(self._prompt_ids)
            self._index = 0
        try:
            await engine._wait_step()
            if self._index == engine.fail_after_tokens:
                raise EngineDead("the engine died")
        except BaseException as error:
            self._end(finished=isinstance(error, EngineDead))
            raise
        finished = self._index == self._num_tokens - 1
        output = engine._output(self._request_id, self._index, len(self._prompt_ids),
                                self._params, finished=finished)
        self._index += 1
        if finished:
            self._end(finished=True)
        return output

    async def aclose(self) -> None:
        if not self._ended and self._index >= 0:
            self._end(finished=False)
        self._ended = True

    def _end(self, *, finished: bool) -> None:
        self._ended = True
        self._engine.running.discard(self._request_id)
        self._engine._ended_lot.unpark_all()
        (self._engine.finished if finished else self._engine.aborted).append(self._request_id)


# -- a server on a free loopback port -------------------------------------------------


@asynccontextmanager
async def running_server(engine: Any, **config: Any) -> AsyncIterator[str]:
    """Serve ``engine`` on 127.0.0.1 (a free port) for the block; yields the base URL."""
    async with trio.open_nursery() as nursery:
        server_config = ServerConfig(host="127.0.0.1", port=0, **config)
        url = await nursery.start(partial(serve_app, engine, server_config))
        yield url
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def openai_clients(url: str) -> AsyncIterator[tuple[Any, Any]]:
    """The official SDK's async and sync clients of the server at ``url``."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    sync_client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    try:
        yield client, sync_client
    finally:
        await client.close()
        sync_client.close()


async def wait_until(predicate: Callable[[], bool], *, max_rounds: int = 1000) -> None:
    """Let every task run until ``predicate`` holds (no wall-clock sleeps)."""
    for _ in range(max_rounds):
        if predicate():
            return
        await wait_all_tasks_blocked()
    raise AssertionError("the condition never held")


class ServerInAThread:
    """A server in its own thread and trio run, for code that calls trio.run itself."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._started: queue.Queue[tuple[str, trio.lowlevel.TrioToken, trio.Event]] = (
            queue.Queue())
        self._thread = threading.Thread(target=trio.run, args=(self._serve,), daemon=True)

    async def _serve(self) -> None:
        stop = trio.Event()
        with trio.fail_after(THREAD_SERVER_TIMEOUT):
            async with running_server(self._engine) as url:
                self._started.put((url, trio.lowlevel.current_trio_token(), stop))
                await stop.wait()

    def __enter__(self) -> str:
        self._thread.start()
        url, self._token, self._stop = self._started.get(timeout=THREAD_SERVER_TIMEOUT)
        return url

    def __exit__(self, *exc_info: object) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(THREAD_SERVER_TIMEOUT)
        assert not self._thread.is_alive()


# -- a raw socket client --------------------------------------------------------------


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


async def open_raw_request(url: str, path: str, body: dict[str, Any]) -> trio.SocketStream:
    """Send one POST over a fresh TCP connection and return the connection."""
    host, port = host_port(url)
    stream = await trio.open_tcp_stream(host, port)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    await stream.send_all(head + payload)
    return stream


async def receive_until(stream: trio.SocketStream, marker: bytes) -> bytes:
    """Read from ``stream`` until ``marker`` has arrived; everything read so far."""
    received = b""
    while marker not in received:
        data = await stream.receive_some(65536)
        assert data, f"the server closed the connection before {marker!r}"
        received += data
    return received


def sse_events(text: str) -> list[str]:
    """The data of every SSE event in a complete response body."""
    return [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]


def sse_json(text: str) -> list[dict[str, Any]]:
    """Every event but [DONE], decoded."""
    return [json.loads(data) for data in sse_events(text) if data != "[DONE]"]


# -- `trio-llm serve` as a child process ----------------------------------------------


class ServeProcess:
    """`trio-llm serve` running in a child process, its log read as it comes.

    ``url`` is known once every API server logged that it serves; ``pids``
    maps "core", "api-server-0", ... to the children's pids (served layout).
    """

    def __init__(self, process: trio.Process, num_api_servers: int) -> None:
        self.process = process
        self.num_api_servers = num_api_servers
        self.log = b""
        self.url = ""
        self.pids: dict[str, int] = {}
        self._grew = trio.lowlevel.ParkingLot()
        self._ended = False

    async def read_log(self) -> None:
        assert self.process.stderr is not None
        async for data in self.process.stderr:
            self.log += data
            self._grew.unpark_all()
        self._ended = True
        self._grew.unpark_all()

    async def wait_for(self, pattern: bytes, *, count: int = 1) -> list[re.Match[bytes]]:
        """Every match of ``pattern`` in the log, once there are ``count`` of them."""
        while len(found := list(re.finditer(pattern, self.log))) < count:
            assert not self._ended, f"the server exited before logging {pattern!r}:\n" + (
                self.log.decode(errors="replace"))
            await self._grew.park()
        return found

    async def wait_serving(self) -> None:
        serving = await self.wait_for(rb"serving 'tiny' at (http://\S+)",
                                      count=max(1, self.num_api_servers))
        self.url = serving[0].group(1).decode()
        for match in re.finditer(rb"(engine core|API server (\d+)): pid (\d+)", self.log):
            name = "core" if match.group(2) is None else f"api-server-{int(match.group(2))}"
            self.pids[name] = int(match.group(3))


@asynccontextmanager
async def serve_process(*flags: str, num_api_servers: int) -> AsyncIterator[ServeProcess]:
    """`trio-llm serve --model tiny` with ``flags`` on a free port, until the block
    ends (then killed, with every child, if still running)."""
    command = [sys.executable, "-m", "trio_llm.api.cli", "serve", "--model", "tiny",
               "--port", "0", "--num-kv-blocks", "64", "--max-model-len", "256",
               "--api-server-count", str(num_api_servers), *flags]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = await trio.lowlevel.open_process(command, stderr=subprocess.PIPE, env=env)
    server = ServeProcess(process, num_api_servers)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.read_log)
            await server.wait_serving()
            yield server
            nursery.cancel_scope.cancel()
    finally:
        for pid in [process.pid, *server.pids.values()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await process.wait()


def is_running(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def api_server_of(connection: trio.SocketStream, server: ServeProcess) -> str:
    """Which API server process holds the other end of ``connection`` (read from
    /proc: the kernel, not the server, decides where a connection lands). The
    server must have accepted it already: call this once a response arrived."""
    local_port = connection.socket.getsockname()[1]
    inode = _server_side_inode(local_port)
    for name, pid in server.pids.items():
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return name
    raise AssertionError(f"no API server holds the connection from port {local_port}")


def _server_side_inode(client_port: int) -> str:
    with open("/proc/net/tcp", encoding="ascii") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            remote_port = int(fields[2].split(":")[1], 16)
            if remote_port == client_port and fields[9] != "0":
                return fields[9]
    raise AssertionError(f"no server socket for client port {client_port}")
