"""Per-request output streams: where the engine hands output to its callers.

Not an actor and not a channel: a registry of coalescing buffers. Publishing
never blocks, so a caller that reads slowly (a slow HTTP client) never stalls
the detokenizer; deltas it has not read yet are merged into one.
"""

from __future__ import annotations

import trio

from trio_llm.actors.errors import EngineError
from trio_llm.actors.messages import RequestOutput


class RequestStream:
    """One request's pending output, read by exactly one caller."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._pending: RequestOutput | None = None
        self._error: EngineError | None = None
        self._lot = trio.lowlevel.ParkingLot()

    def publish(self, output: RequestOutput) -> None:
        if self._pending is None:
            self._pending = output
        else:
            self._pending = _merge(self._pending, output)
        self._lot.unpark_all()

    def fail(self, error: EngineError) -> None:
        self._error = error
        self._lot.unpark_all()

    async def receive(self) -> RequestOutput:
        """Wait for new output; everything published since the last call, merged.

        Raises the request's error once no output is pending.
        """
        if self._pending is None and self._error is None:
            while self._pending is None and self._error is None:
                await self._lot.park()
        else:
            # Parking is this call's checkpoint; without it, take one here.
            # Never both: a task switch per token is the engine's largest
            # per-step cost at large batch.
            await trio.lowlevel.checkpoint()
        if self._pending is not None:
            output, self._pending = self._pending, None
            return output
        assert self._error is not None
        raise self._error


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
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.publish(output)

    def fail(self, request_id: str, error: EngineError) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.fail(error)

    def fail_all(self, error: EngineError) -> None:
        for stream in self._streams.values():
            stream.fail(error)
