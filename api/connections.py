"""An ASGI wrapper that keeps Hypercorn 0.18 from leaving connections hanging.

When a response completes before the request body has all arrived (a 413
for a body over the limit, a 408), or carries ``Connection: close``,
Hypercorn's HTTP/1 protocol closes the connection from inside the app's
final ``send``. It delivers ``http.disconnect`` to the app first, and
Quart-Trio answers that by cancelling the app's nursery, which holds the very
task doing the close: the close is cancelled at its first checkpoint
(``send_eof``), before the socket is closed. The connection is then neither
closed nor recycled; Hypercorn reads and discards whatever the client sends,
and the client's next request on it never gets an answer.

The wrapper holds back an ``http.disconnect`` that arrives once the response
is complete: nothing is left for the app to do then, and Quart-Trio cancels
the receiving task itself as soon as the final ``send`` returns, so the close
runs to its end. A disconnect before the response completes (a client that
hangs up mid-stream) is passed on at once, as before.
"""

from __future__ import annotations

from typing import Any

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGIReceiveEvent, ASGISendCallable, Scope
from quart_trio import QuartTrio


class CompletedResponseGuard:
    """Wraps an ASGI app; see the module docstring."""

    def __init__(self, app: QuartTrio) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response_complete = False

        async def send_tracked(message: Any) -> None:
            nonlocal response_complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # Before the send: the disconnect is delivered inside it.
                response_complete = True
            await send(message)

        async def receive_guarded() -> ASGIReceiveEvent:
            message = await receive()
            if message["type"] == "http.disconnect" and response_complete:
                await trio.sleep_forever()  # cancelled by the app once its send returns
            return message

        await self.app(scope, receive_guarded, send_tracked)
