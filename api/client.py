"""A small trio client for a trio-llm (or any OpenAI-compatible) server.

    async with CompletionClient("http://127.0.0.1:8000") as client:
        async with client.stream({"prompt": "Hello", "max_tokens": 16}) as chunks:
            async for chunk in chunks:
                print(chunk.text, end="")

Cancel-safe: leaving the ``stream`` block early, or a cancel scope around it,
closes the connection, and the server aborts the request. The response is
read by a task of the block's own nursery and handed over a channel, so that
stopping early cancels the read instead of abandoning httpx's async
generators half-way.

No method takes a timeout: wrap calls in ``trio.fail_after``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import trio

from trio_llm.api.protocol import ErrorInfo, Usage

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
CONNECT_TIMEOUT_SECONDS = 30.0


class CompletionError(Exception):
    """The server refused the request or failed it mid-stream (OpenAI's error body)."""

    def __init__(self, message: str, *, status: int | None = None, param: str | None = None,
                 error_type: str | None = None) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.message = message
        self.status = status
        self.param = param
        self.error_type = error_type


class StreamChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One server-sent event of a streamed completion.

    ``text`` is the new text (a completion's text or a chat delta's content);
    ``usage`` is set on the last event when the request asked for it;
    ``arrival_time`` is ``trio.current_time()`` when the event was read.
    """

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    arrival_time: float


class _ChatDelta(msgspec.Struct):
    content: str | None = None


class _EventChoice(msgspec.Struct):
    text: str | None = None
    delta: _ChatDelta | None = None
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    """A streamed chunk of either endpoint, or an error event."""

    choices: list[_EventChoice] = []
    usage: Usage | None = None
    error: ErrorInfo | None = None


class _ErrorBody(msgspec.Struct):
    error: ErrorInfo


_event_decoder = msgspec.json.Decoder(_Event)


class CompletionStream:
    """The chunks of one streamed request; raises CompletionError if the server
    failed the request after the stream started."""

    def __init__(self, receive: trio.MemoryReceiveChannel[StreamChunk | Exception]) -> None:
        self._receive = receive

    def __aiter__(self) -> CompletionStream:
        return self

    async def __anext__(self) -> StreamChunk:
        try:
            item = await self._receive.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        if isinstance(item, Exception):
            raise item
        return item


class CompletionClient:
    """An HTTP client bound to one server. ``api_key`` is sent as a bearer token."""

    def __init__(self, base_url: str, *, api_key: str | None = None) -> None:
        headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        # No read timeout: a long generation is not a failure. No pool limit:
        # a benchmark's concurrency must not queue inside the client.
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers,
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_SECONDS),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def models(self) -> list[dict[str, Any]]:
        """GET /v1/models: the served models' cards."""
        response = await self._http.get("/v1/models")
        _raise_for_error(response)
        return list(response.json()["data"])

    async def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST /tokenize (vLLM's and trio-llm's): the decoded response body."""
        response = await self._http.post("/tokenize", json=request)
        _raise_for_error(response)
        return dict(response.json())

    async def detokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST /detokenize (vLLM's and trio-llm's): the decoded response body."""
        response = await self._http.post("/detokenize", json=request)
        _raise_for_error(response)
        return dict(response.json())

    async def complete(self, request: dict[str, Any], *,
                       path: str = COMPLETIONS_PATH) -> dict[str, Any]:
        """One non-streamed request; the decoded response body."""
        response = await self._http.post(path, json={**request, "stream": False})
        _raise_for_error(response)
        return dict(response.json())

    @asynccontextmanager
    async def stream(self, request: dict[str, Any], *,
                     path: str = COMPLETIONS_PATH) -> AsyncIterator[CompletionStream]:
        """Stream one request (``stream`` is set for you). Raises CompletionError
        at once if the server refuses it (4xx/5xx)."""
        http_request = self._http.build_request("POST", path, json={**request, "stream": True})
        response = await self._http.send(http_request, stream=True)
        try:
            if response.status_code != 200:
                await response.aread()
                _raise_for_error(response)
            send, receive = trio.open_memory_channel[StreamChunk | Exception](0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_events, response, send)
                try:
                    yield CompletionStream(receive)
                finally:
                    # Ends the reader: a pending hand-over fails, the next read too.
                    receive.close()
                    await _close_response(response)
        except BaseExceptionGroup as group:
            # The reader never raises: the one exception is the caller's own.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            await _close_response(response)


async def _close_response(response: httpx.Response) -> None:
    # Closing a response that was not read to the end drops its connection,
    # and the server aborts the request.
    with trio.CancelScope(shield=True):
        await response.aclose()


async def _read_events(response: httpx.Response,
                       send: trio.MemorySendChannel[StreamChunk | Exception]) -> None:
    """Read the SSE stream to its end, handing each chunk over.

    Shielded, because cancelling it while it waits to hand a chunk over would
    abandon httpx's async generators half-way. It ends anyway once the stream
    owner closes the channel and the response (see ``stream``): then the next
    read fails inside httpx and unwinds its generators cleanly.
    """
    with trio.CancelScope(shield=True):
        async with send:
            try:
                async for line in response.aiter_lines():
                    item = _item_of_line(line)
                    if item is not None:
                        await _hand_over(send, item)
            except (httpx.HTTPError, httpx.StreamError) as error:
                await _hand_over(send, error)


def _item_of_line(line: str) -> StreamChunk | Exception | None:
    if not line.startswith("data:"):
        return None
    data = line.removeprefix("data:").strip()
    if data == "[DONE]":
        return None
    try:
        return _chunk_of(_event_decoder.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError, CompletionError) as error:
        return error


async def _hand_over(send: trio.MemorySendChannel[StreamChunk | Exception],
                     item: StreamChunk | Exception) -> None:
    try:
        await send.send(item)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the owner left; keep reading until the closed response stops us


def _chunk_of(event: _Event) -> StreamChunk:
    if event.error is not None:
        raise CompletionError(event.error.message, status=event.error.code,
                              param=event.error.param, error_type=event.error.type)
    text, finish_reason = "", None
    for choice in event.choices:
        text += choice.text or (choice.delta.content if choice.delta else None) or ""
        finish_reason = choice.finish_reason or finish_reason
    return StreamChunk(text=text, finish_reason=finish_reason, usage=event.usage,
                       arrival_time=trio.current_time())


def _raise_for_error(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        error = msgspec.json.decode(response.content, type=_ErrorBody).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise CompletionError(response.text or response.reason_phrase,
                              status=response.status_code) from None
    raise CompletionError(error.message, status=response.status_code, param=error.param,
                          error_type=error.type)
