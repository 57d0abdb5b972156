"""The Draft stream over a Unix socket, beside gRPC, for a drafter on the verifier's own host.

The handshake stays on gRPC (its checks, TLS and token apply there); only the per-round DraftStep /
DraftResult messages move to the socket, each as a 4-byte little-endian length and the protobuf's bytes.
That skips HTTP/2 framing and grpc's per-message machinery, the floor of a gRPC round trip
(bench/results/link_round_trip_cpu/). The drafter's first message on a new connection is its DrafterInfo,
so that a verifier can tell the socket belongs to the drafter it shook hands with. The socket file is
owner-only (0600): no other user of the host can connect, so it needs no token of its own.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Awaitable, Callable

from google.protobuf.message import DecodeError, Message

_HEADER = struct.Struct("<I")
_HIGH_WATER = 1 << 20  # bytes written but not yet taken by the socket before a writer waits for it


class FrameError(ValueError):
    """Bytes from the other end that are not a message of the stream (the message says what is wrong)."""


class MessageSocket:
    """One connection's messages: `read` the next one of `message_type`, `write` one, `close`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 message_type: type[Message], max_bytes: int):
        self._reader, self._writer = reader, writer
        self._type, self.max_bytes = message_type, max_bytes

    @classmethod
    async def connect(cls, path: str, message_type: type[Message], max_bytes: int) -> MessageSocket:
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=_HIGH_WATER)
        except OSError as e:
            raise OSError(e.errno, f"step socket {path}: {e.strerror}") from None
        return cls(reader, writer, message_type, max_bytes)

    async def read(self, message_type: type[Message] | None = None) -> Message | None:
        """The next message (of the stream's type unless given); None when the other end closed the stream
        between messages."""
        message_type = message_type or self._type
        try:
            header = await self._reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as e:
            if e.partial:
                raise FrameError("the stream ended inside a message's length") from None
            return None
        (size,) = _HEADER.unpack(header)
        if size > self.max_bytes:
            raise FrameError(f"a {size}-byte {message_type.__name__} is over the {self.max_bytes}-byte limit")
        try:
            data = await self._reader.readexactly(size)
        except asyncio.IncompleteReadError as e:
            raise FrameError(f"the stream ended {len(e.partial)} bytes into a {size}-byte message") from None
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            raise FrameError(f"undecodable {message_type.__name__} ({size} bytes): {e}") from None

    async def write(self, message: Message) -> None:
        self.write_now(message)
        if self.unread_bytes > _HIGH_WATER:
            await self._writer.drain()  # the reader is slow: wait rather than buffer without bound

    @property
    def unread_bytes(self) -> int:
        """Bytes written that the other end has not taken yet."""
        return self._writer.transport.get_write_buffer_size()

    def write_now(self, message: Message) -> None:
        """As write, for a caller on the loop that cannot wait: the socket takes the message at once (it is
        buffered only while the reader is slow; such a caller bounds how many it sends)."""
        if self._writer.is_closing():  # the other end left (uvloop would raise RuntimeError, not OSError)
            raise ConnectionResetError("the step socket is closed")
        data = message.SerializeToString()
        if len(data) > self.max_bytes:
            raise FrameError(f"a {len(data)}-byte {type(message).__name__} is over the {self.max_bytes}-byte "
                             "limit")
        self._writer.writelines((_HEADER.pack(len(data)), data))

    def close(self) -> None:
        """Ends the stream: a read waiting here or at the other end then sees its end."""
        self._writer.close()

    cancel = close  # the name a grpc.aio stream call gives it, so the link treats both alike


async def serve(path: str, on_connection: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                                    Awaitable[None]]) -> asyncio.Server:
    """Listens on the Unix socket `path`, owner-only (the loop replaces a stale socket file there). A path it
    cannot take (another file there, no such directory) is bad input: ValueError, saying why."""
    old_mask = os.umask(0o177)  # created 0600: no moment at which others could connect
    try:
        return await asyncio.start_unix_server(on_connection, path, limit=_HIGH_WATER)
    except OSError as e:
        raise ValueError(f"cannot listen on the step socket {path}: {e.strerror or e}") from None
    finally:
        os.umask(old_mask)
