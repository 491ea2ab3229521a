"""Per-request output streams: where the engine hands output to its callers.

Not an actor and not a channel: a registry of coalescing buffers. Publishing
never blocks, so a caller that reads slowly (a slow HTTP client) never stalls
the detokenizer; deltas it has not read yet are merged into one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import trio

from trio_llm.actors.errors import EngineError
from trio_llm.actors.messages import RequestOutput


class OutputSink(Protocol):
    """Where an actor publishes requests' output: the RequestStreams of this
    process, or (in the engine core) the wire to the front that owns the request."""

    def publish(self, output: RequestOutput) -> None: ...

    def fail(self, request_id: str, error: EngineError) -> None: ...


class RequestStream:
    """One request's pending output, read by exactly one caller."""

    __slots__ = ("request_id", "_pending", "_error", "_reader", "group")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: RequestOutput | None = None
        self._error: EngineError | None = None
        self._reader: trio.lowlevel.Task | None = None
        # set when the stream is read through a StreamGroup (several choices of one call)
        self.group: StreamGroup | None = None

    def publish(self, output: RequestOutput) -> None:
        """Hand output to the reader, merged into what it has not read yet."""
        if self._pending is None:
            self._pending = output
        else:
            self._pending = _merge(self._pending, output)
        self._wake_reader()

    def fail(self, error: EngineError) -> None:
        """End the stream: ``receive`` raises ``error`` once the pending output is read."""
        self._error = error
        self._wake_reader()

    def _wake_reader(self) -> None:
        if self._reader is not None:
            trio.lowlevel.reschedule(self._reader)
            self._reader = None
        if self.group is not None:
            self.group.wake()

    @property
    def is_ready(self) -> bool:
        """Whether ``receive`` would return (or raise) at once."""
        return self._pending is not None or self._error is not None

    async def receive(self) -> RequestOutput:
        """Wait for new output; everything published since the last call, merged.

        Raises the request's error once no output is pending.
        """
        # One task switch per call, never two: at large batch, waking each
        # request's reader once per step is the engine's largest per-step cost.
        # A single reader needs no ParkingLot: it parks itself directly.
        if self._pending is None and self._error is None:
            assert self._reader is None, "a request stream has one reader"
            self._reader = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._reader = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)
        else:
            await trio.lowlevel.checkpoint()
        if self._pending is not None:
            output, self._pending = self._pending, None
            return output
        assert self._error is not None
        raise self._error


class StreamGroup:
    """Several streams read by one task, in turn: the choices of one call (``n``,
    ``best_of``, batched prompts). No task per stream: the reader parks once on
    the group, and a publish to any member wakes it."""

    __slots__ = ("streams", "_reader", "_next_index", "last_index")

    def __init__(self, streams: list[RequestStream]) -> None:
        self.streams = streams
        self._reader: trio.lowlevel.Task | None = None
        self._next_index = 0
        # the member the latest receive read (or whose error it raised)
        self.last_index = 0
        for stream in streams:
            stream.group = self

    def wake(self) -> None:
        if self._reader is not None:
            trio.lowlevel.reschedule(self._reader)
            self._reader = None

    async def receive(self, is_open: list[bool]) -> tuple[int, RequestOutput]:
        """(index, output) of the next member with output, round robin over the members
        still ``is_open``; raises a member's error as ``RequestStream.receive`` does."""
        while True:
            index = self._ready_index(is_open)
            if index is not None:
                self._next_index = self.last_index = index
                self._next_index += 1
                return index, await self.streams[index].receive()
            assert self._reader is None, "a stream group has one reader"
            self._reader = trio.lowlevel.current_task()

            def abort(_: object) -> trio.lowlevel.Abort:
                self._reader = None
                return trio.lowlevel.Abort.SUCCEEDED

            await trio.lowlevel.wait_task_rescheduled(abort)

    def _ready_index(self, is_open: list[bool]) -> int | None:
        num_streams = len(self.streams)
        for offset in range(num_streams):
            index = (self._next_index + offset) % num_streams
            if is_open[index] and self.streams[index].is_ready:
                return index
        return None


def _merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    logprobs = None
    if older.logprobs is not None or newer.logprobs is not None:
        logprobs = (older.logprobs or []) + (newer.logprobs or [])
    return RequestOutput(
        request_id=newer.request_id,
        token_ids=older.token_ids + newer.token_ids,
        text=older.text + newer.text,
        logprobs=logprobs,
        finished=newer.finished,
        finish_reason=newer.finish_reason,
        stop_reason=newer.stop_reason,
        num_prompt_tokens=newer.num_prompt_tokens,
        num_output_tokens=newer.num_output_tokens,
        queue_time=older.queue_time if older.queue_time is not None else newer.queue_time,
        prompt_token_ids=(older.prompt_token_ids if older.prompt_token_ids is not None
                          else newer.prompt_token_ids),
        prompt_logprobs=(older.prompt_logprobs if older.prompt_logprobs is not None
                         else newer.prompt_logprobs),
        embedding=newer.embedding,  # only ever on a request's last output
    )


class RequestStreams:
    """The registry of open streams. The facade opens and closes them; intake,
    queue and detokenizer publish to them by request id. Output for a request
    whose caller has gone (stream closed) is dropped."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._emptied = trio.lowlevel.ParkingLot()

    def open(self, request_id: str) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id)
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._emptied.unpark_all()

    async def wait_empty(self) -> None:
        """Wait until every open stream was closed (the engine is drained)."""
        while self._streams:
            await self._emptied.park()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def publish(self, output: RequestOutput) -> None:
        self.publish_all((output,))

    def publish_all(self, outputs: Iterable[RequestOutput]) -> None:
        """Publish each output to its request's stream (one step's worth at once)."""
        streams = self._streams
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                stream.publish(output)

    def fail(self, request_id: str, error: EngineError) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def fail_all(self, error: EngineError) -> None:
        for stream in self._streams.values():
            stream.fail(error)
