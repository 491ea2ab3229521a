"""Strict HTTP/1.1 message framing: no request whose length two parsers could read
differently (request smuggling, RFC 9112 section 6.3).

Hypercorn 0.18 parses HTTP/1.1 with h11 0.16, which (checked on those versions)
reads a request carrying both Content-Length and Transfer-Encoding as chunked and
keeps the connection open, so a second request hidden in the same bytes is
answered too; and it unfolds an obs-folded header (a line starting with a space
continues the one before), so ``Transfer-Encoding:\\r\\n chunked`` is chunked to
it while a proxy in front may see no Transfer-Encoding at all.

Two checks close both, whatever Hypercorn does by default:

- ``refuse_obsolete_line_folding``: where h11 unfolds header lines, before any
  header reaches the app (the unfolded value no longer shows the fold), a
  continuation line is refused, and so is a header block with both lengths.
  Hypercorn answers h11's error with a 400 carrying ``Connection: close`` and
  closes the connection, as it does for any malformed header, so nothing after it
  on the connection is parsed. RFC 9112 (5.2) allows a server to refuse obs-fold
  with 400. It applies to every h11 connection of the process: a server has no use
  for obs-fold, and this module is imported only by the server.
- ``StrictFraming`` (ASGI), the second line should h11's reader change: a request
  with both headers gets a 400 carrying ``Connection: close`` and its body is
  never read; Hypercorn then closes the connection (h11 cannot start a next request
  on a connection whose request body was left unread). Alone it raced Hypercorn
  under load (the probe saw a BusyResourceError and no answer once).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import h11
import h11._readers as h11_readers
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

# What a folded line starts with (h11's own test for a continuation line).
_FOLD_START = (b" ", b"\t")
_LENGTH_HEADERS = frozenset({b"content-length", b"transfer-encoding"})


class StrictFraming:
    """Wraps an ASGI app: a request with both Content-Length and Transfer-Encoding
    is answered 400 with ``Connection: close`` and never reaches the app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable,
                       send: ASGISendCallable) -> None:
        if scope["type"] == "http" and _has_both_lengths(scope["headers"]):
            await _refuse(send, "a request may not carry both Content-Length and "
                                "Transfer-Encoding (RFC 9112, 6.3)")
            return
        await self.app(scope, receive, send)


def _has_both_lengths(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


async def _refuse(send: ASGISendCallable, message: str) -> None:
    body = ('{"error": {"message": "' + message + '", "type": "BadRequestError", '
            '"param": null, "code": 400}}').encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")],
                "trailers": False})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _unfolded_lines(lines: Iterable[bytes]) -> Iterator[bytes]:
    """h11's header lines, refusing a continuation line instead of unfolding it, and
    a message with both Content-Length and Transfer-Encoding."""
    seen: set[bytes] = set()
    for line in lines:
        if line.startswith(_FOLD_START):
            raise h11.LocalProtocolError("obsolete line folding (obs-fold) in a header is "
                                         "refused (RFC 9112, 5.2)")
        name = bytes(line.split(b":", 1)[0]).strip().lower()
        if name in _LENGTH_HEADERS:
            seen.add(name)
            if len(seen) == len(_LENGTH_HEADERS):
                raise h11.LocalProtocolError("both Content-Length and Transfer-Encoding "
                                             "(RFC 9112, 6.3)")
        yield line


def refuse_obsolete_line_folding() -> None:
    """Make h11 refuse obs-fold in the headers it reads (see the module docstring).
    h11 reports it as a RemoteProtocolError, which Hypercorn answers with 400 and
    closes the connection. Idempotent."""
    h11_readers._obsolete_line_fold = _unfolded_lines


def strictly_framed(app: Any) -> StrictFraming:
    """The app behind both framing checks (the server's one hook)."""
    refuse_obsolete_line_folding()
    return StrictFraming(app)
