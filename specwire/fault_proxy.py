"""A real TCP proxy on the loopback interface that injects network faults between two services.

Put it between the verifier and the drafter (`--drafter 127.0.0.1:<proxy port>`) and switch it, while
traffic flows, between `heal()` (bytes pass), `stall()` (bytes are held, connections stay open: a frozen
peer), `slow(seconds)` (each chunk waits before it is forwarded: a congested link) and `drop()` (every open
connection is reset; new ones are accepted and forwarded). Used by tests/test_faults.py and bench/soak.py.
Only loopback addresses are accepted: the proxy is a test instrument, not a relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket

_CHUNK = 64 * 1024


def _loopback(host: str) -> str:
    address = socket.gethostbyname(host)
    if not ipaddress.ip_address(address).is_loopback:
        raise ValueError(f"the fault proxy only runs on loopback addresses, not {host} ({address})")
    return address


class FaultProxy:
    """Forwards 127.0.0.1:<port> to `target_host:target_port`, with faults switched on and off at will."""

    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1"):
        self.target = (_loopback(target_host), target_port)
        self.listen_host = _loopback(listen_host)
        self.port: int | None = None
        self.connections = 0  # accepted since start (a reconnect shows up here)
        self.forwarded_bytes = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._delay = 0.0
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._accept, self.listen_host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self.drop()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # ------------------------------------------------------------------------------------------ faults

    def heal(self) -> None:
        """Bytes pass again, at full speed; held bytes go out in order."""
        self._delay = 0.0
        self._flowing.set()

    def stall(self) -> None:
        """Hold every byte in both directions; connections stay open (the peer looks frozen)."""
        self._flowing.clear()

    def slow(self, seconds_per_chunk: float) -> None:
        """Delay each forwarded chunk (up to 64 KiB) by `seconds_per_chunk`."""
        self._delay = seconds_per_chunk
        self._flowing.set()

    def drop(self) -> None:
        """Reset every open connection (both sides see the link break); new connections are accepted."""
        for writer in list(self._open):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._open.clear()

    # ------------------------------------------------------------------------------------------ plumbing

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.transport.abort()  # the target is down: the caller sees a refused link
            return
        self._open |= {client_writer, upstream_writer}
        pumps = [asyncio.create_task(self._pump(client_reader, upstream_writer)),
                 asyncio.create_task(self._pump(upstream_reader, client_writer))]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for writer in (client_writer, upstream_writer):
            self._open.discard(writer)
            with contextlib.suppress(Exception):
                writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(_CHUNK):
                await self._flowing.wait()
                if self._delay:
                    await asyncio.sleep(self._delay)
                writer.write(data)
                await writer.drain()
                self.forwarded_bytes += len(data)
