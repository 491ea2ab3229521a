"""What every streaming endpoint shares: its engine request closed however the
response ends, the SSE response started at its first event, and the request's
metrics observed as outputs arrive. The endpoint modules (server.py, responses.py)
import it; it imports none of them."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractContextManager, aclosing, asynccontextmanager
from typing import Any, Protocol

import trio
from quart_trio.wrappers.response import TrioResponse as Response

from trio_llm.actors.messages import RequestOutput
from trio_llm.api.metrics import RequestTimer

# Closing a request's output stream only sends an Abort to the engine; bound it
# anyway, since it runs shielded.
CLOSE_TIMEOUT_SECONDS = 5.0


def observe(timer: RequestTimer, output: RequestOutput) -> None:
    now = trio.current_time()
    timer.on_output(now, num_new_tokens=len(output.token_ids), queue_time=output.queue_time)
    if output.finished:
        timer.on_finish(now, output.finish_reason, num_prompt_tokens=output.num_prompt_tokens,
                        num_output_tokens=output.num_output_tokens)


async def event_stream(events: AsyncGenerator[bytes, None]) -> Response:
    """The SSE response of ``events``, run to its first event before answering, so
    that a request the engine refuses gets its 4xx/503 status rather than an error
    event inside a 200. Once started, the generator's cleanup runs however it ends,
    even if the response is dropped before Quart sends it."""
    first_event = await anext(events)
    return Response(_resumed(first_event, events), content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _resumed(first_event: bytes,
                   events: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    """``events`` again, from its first event that was already taken."""
    async with aclosing(events):
        yield first_event
        async for event in events:
            yield event


@asynccontextmanager
async def closing(outputs: AsyncIterator[Any]) -> AsyncIterator[None]:
    """Close ``outputs`` on the way out, even when cancelled: the engine aborts
    the request unless it had finished."""
    try:
        yield
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            with trio.move_on_after(CLOSE_TIMEOUT_SECONDS, shield=True):
                await aclose()


class OutputBuilder(Protocol):
    """A whole response, built from a request's outputs (protocol.py's builders,
    responses.py's)."""

    def add(self, output: RequestOutput) -> None: ...


async def build_whole(outputs: AsyncIterator[RequestOutput], builder: OutputBuilder,
                      timer: RequestTimer, log_line: Callable[[], AbstractContextManager[None]]
                      ) -> None:
    """Feed every output of a non-streamed request to ``builder``, timed and logged;
    the stream is closed however it ends."""
    with log_line():
        async with closing(outputs):
            async for output in outputs:
                observe(timer, output)
                builder.add(output)
