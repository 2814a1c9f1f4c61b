"""A connection's reads for spotdrain.http1: kept until its reader takes them, or handed to a callback as they come.

Two protocols: ``Reads`` takes each read as the bytes the transport makes of it (``data_received``: one call into
Python a read, for a relayed stream's small ones); ``BufferedReads`` has the socket read into one buffer that every
connection of the process shares (``asyncio.BufferedProtocol``: reads are one after another), so that a sized body's
writer takes each read from there with no copy (a model fetch's large ones).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import cast

HELD_MAX_BYTES = 128 * 1024  # read but not yet relayed, before the backend's socket is read no more
BUFFER = bytearray(256 * 1024)  # every buffered read of the process goes here first: reads are one after another
VIEW = memoryview(BUFFER)


class Reads(asyncio.Protocol):
    """A connection's reads, each as the bytes the transport made of it."""

    __slots__ = ("_loop", "_waiter", "blocks", "born", "eof", "error", "held", "paused", "sink", "transport")

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None  # kept once asked: asking makes a getpid system call
        self.transport: asyncio.Transport | None = None
        self.blocks: list[bytes] = []  # a list, not a deque: an open stream holds one, and a deque is 600 bytes
        self.held = 0  # bytes in ``blocks``
        self.paused = False
        self.eof = False
        self.error: BaseException | None = None
        self.sink: Callable[[bytes], None] | None = None  # takes every read instead of ``blocks``
        self._waiter: asyncio.Future[None] | None = None
        self.born = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is one, without being asyncio's class

    def data_received(self, data: bytes) -> None:
        if self.sink is not None:
            self.sink(data)  # it wakes the reader itself, once it has had all it wants
            return
        self.blocks.append(data)
        self.held += len(data)
        if self.held > HELD_MAX_BYTES:
            self.pause()  # the reader reads slower than the server writes: let the kernel hold the rest
        self.wake()

    def eof_received(self) -> bool:
        self.eof = True
        self.wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self.error = self.error or exc
        self.wake()

    @property
    def open(self) -> bool:
        """Neither end has closed the connection."""
        return self.transport is not None and not self.transport.is_closing() and not self.eof

    @property
    def idle(self) -> bool:
        """Open, nothing read since its last answer ended (``Answer.release``), no reader: fit for another request."""
        return self.sink is None and not self.blocks and self.open

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _future(self) -> asyncio.Future[None]:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.create_future()

    async def wait(self, timeout_s: float | None = None) -> None:
        """Until woken (a read, the end of the connection), or TimeoutError after ``timeout_s``."""
        self._waiter = self._future()
        try:
            if timeout_s is None:
                await self._waiter
            else:
                async with asyncio.timeout(timeout_s):
                    await self._waiter
        finally:
            self._waiter = None

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    async def next_block(self) -> bytes | None:
        """Every byte read since the last call, as one block, or None once the connection has ended."""
        while not self.blocks:
            if self.eof:
                if self.error is not None:
                    raise ConnectionResetError(str(self.error) or type(self.error).__name__)
                return None
            self._waiter = self._future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        block = self.blocks[0] if len(self.blocks) == 1 else b"".join(self.blocks)
        self.blocks.clear()
        self.held = 0
        self.resume()  # nothing is held now: the socket is read again
        return block


class BufferedReads(Reads, asyncio.BufferedProtocol):
    """A connection read into the process's one buffer: ``view_sink`` takes each read from there, with no copy made
    (``Answer.write_body``); without it, the read is copied out as bytes, as ``Reads`` has it."""

    __slots__ = ("view_sink",)

    def __init__(self) -> None:
        super().__init__()
        self.view_sink: Callable[[memoryview], None] | None = None

    def get_buffer(self, sizehint: int) -> memoryview:
        return VIEW

    def buffer_updated(self, nbytes: int) -> None:
        if self.view_sink is not None:
            self.view_sink(VIEW[:nbytes])
            return
        self.data_received(bytes(VIEW[:nbytes]))
