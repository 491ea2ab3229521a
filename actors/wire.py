"""Channels over a local socket: trio's SendChannel/ReceiveChannel interface,
carrying the engine's msgspec messages between processes.

Where an edge of the actor graph crosses a process boundary (docs/architecture.md,
"Processes"), the supervisor of each side wraps the socket in a WireSendChannel
and a WireReceiveChannel. An actor cannot tell them from memory channels: the
same messages go in and come out, in order.

A frame is a 4-byte big-endian length, then one message encoded with msgspec
(msgpack by default: measured faster than JSON on the engine's own messages,
see docs/performance.md, "Wire format"). The receiving side decodes into the
tagged union it expects, so a message of the wrong kind is a loud error, not a
silent mismatch.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Generic, Literal, TypeVar

import msgspec
import trio

WireFormat = Literal["msgpack", "json"]
DEFAULT_WIRE_FORMAT: WireFormat = "msgpack"

# A frame larger than this is a protocol error (a corrupt length), not a message:
# the largest real ones are a batch of token deltas or a long prompt.
MAX_FRAME_BYTES = 256 * 1024 * 1024
RECEIVE_CHUNK_BYTES = 256 * 1024
_LENGTH = struct.Struct(">I")

MessageType = TypeVar("MessageType")


class WireError(Exception):
    """The peer sent bytes that are not a frame of the expected messages."""


class WireEncoder:
    """Encodes messages into length-prefixed frames."""

    def __init__(self, wire_format: WireFormat = DEFAULT_WIRE_FORMAT) -> None:
        self._encoder: msgspec.msgpack.Encoder | msgspec.json.Encoder = (
            msgspec.msgpack.Encoder() if wire_format == "msgpack" else msgspec.json.Encoder())
        self._buffer = bytearray()

    def frame(self, message: Any) -> bytes:
        buffer = self._buffer
        # Encode after a 4-byte gap, then write the length into the gap: one copy.
        self._encoder.encode_into(message, buffer, _LENGTH.size)
        _LENGTH.pack_into(buffer, 0, len(buffer) - _LENGTH.size)
        return bytes(buffer)


class WireDecoder(Generic[MessageType]):
    """Splits a byte stream into frames and decodes each into ``message_type``."""

    def __init__(self, message_type: type[MessageType],
                 wire_format: WireFormat = DEFAULT_WIRE_FORMAT) -> None:
        self._decoder: msgspec.msgpack.Decoder[MessageType] | msgspec.json.Decoder[MessageType] = (
            msgspec.msgpack.Decoder(message_type) if wire_format == "msgpack"
            else msgspec.json.Decoder(message_type))
        self._buffer = bytearray()
        self._start = 0

    def feed(self, data: bytes) -> list[MessageType]:
        """Add received bytes; every message they complete, in order."""
        buffer = self._buffer
        buffer += data
        messages = []
        start, end = self._start, len(buffer)
        view = memoryview(buffer)
        try:
            while end - start >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(buffer, start)
                if length > MAX_FRAME_BYTES:
                    raise WireError(f"a frame of {length} bytes: not a frame of this protocol")
                if end - start - _LENGTH.size < length:
                    break
                with view[start + _LENGTH.size:start + _LENGTH.size + length] as body:
                    try:
                        messages.append(self._decoder.decode(body))
                    except (msgspec.DecodeError, msgspec.ValidationError,
                            RecursionError) as error:
                        raise WireError(f"an undecodable frame: {error}") from error
                start += _LENGTH.size + length
        finally:
            view.release()
        if start == end:
            buffer.clear()
            start = 0
        elif start > RECEIVE_CHUNK_BYTES:
            del buffer[:start]
            start = 0
        self._start = start
        return messages

    @property
    def has_partial_frame(self) -> bool:
        return len(self._buffer) > self._start


class WireSendChannel(trio.abc.SendChannel[MessageType]):
    """The sending half of a wire channel. Several tasks may send at once
    (each frame goes out whole); closing it shuts the socket's write side, so
    the peer's WireReceiveChannel ends with EndOfChannel."""

    def __init__(self, stream: trio.SocketStream,
                 wire_format: WireFormat = DEFAULT_WIRE_FORMAT) -> None:
        self._stream = stream
        self._encoder = WireEncoder(wire_format)
        self._lock = trio.StrictFIFOLock()
        self._closed = False

    async def send(self, value: MessageType) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the wire channel is closed")
        frame = self._encoder.frame(value)
        async with self._lock:
            await self._stream.send_all(frame)

    async def aclose(self) -> None:
        """Shut the socket's write side: the peer's receiving half ends once it
        has read every frame sent before. Never waits (it runs in cleanup)."""
        self._closed = True
        self._shutdown(socket.SHUT_WR)
        await trio.lowlevel.checkpoint()

    def disconnect(self) -> None:
        """Cut the connection both ways at once (a peer that reads nothing)."""
        self._closed = True
        self._shutdown(socket.SHUT_RDWR)

    def _shutdown(self, how: int) -> None:
        try:
            self._stream.socket.shutdown(how)
        except OSError:
            pass  # closed already, or the peer is gone: nothing to tell it


class WireReceiveChannel(trio.abc.ReceiveChannel[MessageType]):
    """The receiving half of a wire channel: messages in the order they were sent.

    EndOfChannel once the peer closed its sending half, or its process ended
    (a process that dies closes its sockets; the kernel tells this side).
    """

    def __init__(self, stream: trio.SocketStream, message_type: type[MessageType],
                 wire_format: WireFormat = DEFAULT_WIRE_FORMAT) -> None:
        self._stream = stream
        self._decoder = WireDecoder(message_type, wire_format)
        self._ready: list[MessageType] = []
        self._next = 0

    async def receive(self) -> MessageType:
        if self._next < len(self._ready):
            await trio.lowlevel.checkpoint()
        while self._next == len(self._ready):
            try:
                data = await self._stream.receive_some(RECEIVE_CHUNK_BYTES)
            except trio.BrokenResourceError:
                data = b""  # reset by a peer that died: the channel ended all the same
            if not data:
                if self._decoder.has_partial_frame:
                    raise WireError("the peer went away in the middle of a frame")
                raise trio.EndOfChannel
            self._ready, self._next = self._decoder.feed(data), 0
        message = self._ready[self._next]
        self._next += 1
        return message

    async def aclose(self) -> None:
        await self._stream.aclose()


def open_wire_channel(
    stream: trio.SocketStream, receive_type: Any, *,
    wire_format: WireFormat = DEFAULT_WIRE_FORMAT,
) -> tuple[WireSendChannel[Any], WireReceiveChannel[Any]]:
    """Both halves of a wire channel over one connected local socket. ``receive_type``
    is a message type or a union of them (which ``type[...]`` cannot spell)."""
    return (WireSendChannel(stream, wire_format),
            WireReceiveChannel(stream, receive_type, wire_format))
