"""``--workers N``: the workers take new connections in turn, the first alone until it is busy.

A worker's CPU per chunk grows as its load spreads thinner: each wakeup of its event loop relays fewer chunks, and
the workers and the streams' other processes contend for the same cores (measured in bench/gateway_peers.py: a
Python relay that parses nothing costs 21 µs a chunk at 100 streams over two workers and 16 on one). So the workers
share one listening socket, which the parent makes, and only the first takes connections until its CPU time passes
``--spill-at`` of the wall time (0.5 by default): then the second takes them too, until the first is under ``STAY``
of that again; the third while both before it are past it, and so on (``--spill-at 0``: every worker from the
start). A connection stays where it was accepted: a worker past the bound while the next takes connections answers
with ``Connection: close`` (``Server.shedding``), so that the clients that keep their connections (an OpenAI SDK's
pool) connect again, to the worker with room.

Each worker writes what it saw each ``TICK_S`` to a board the parent made (a small file in the metrics directory,
shared by ``mmap``): when, how busy, whether it takes connections. A worker whose entry is older than ``STALE_S``
(starting, killed, or the parent cleared it when it exited) counts as past the bound, so the next takes its share at
once; a connection made while no worker takes any waits in the socket's backlog, not refused.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from gateway.server import Listen, Server, bound_unsent

log = structlog.get_logger()

LISTEN_FD_ENV = "SPOTDRAIN_GATEWAY_LISTEN_FD"  # the shared socket, in a worker's environment
BOARD_ENV = "SPOTDRAIN_GATEWAY_BOARD"  # the board's path, likewise
TICK_S = 0.5
STAY = 0.6  # a worker past ``--spill-at`` lets the next take connections until it is under this much of it again
STALE_S = 2.0
BACKLOG = 1024
_ENTRY = struct.Struct("=ddd")  # when (time.monotonic), busy (CPU over wall time), takes connections (1.0 or 0.0)


@dataclass(frozen=True, slots=True)
class Seen:
    at: float
    busy: float
    serving: bool

    def stale(self, now: float) -> bool:
        """Not heard from: starting, or gone."""
        return now - self.at > STALE_S

    def full(self, now: float, bound: float) -> bool:
        return self.stale(now) or self.busy >= bound


class Board:
    """The workers' entries, in a file each process maps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("r+b") as file:
            self.map = mmap.mmap(file.fileno(), 0)

    @classmethod
    def create(cls, path: Path, count: int) -> Board:
        path.write_bytes(bytes(_ENTRY.size * count))
        return cls(path)

    def read(self) -> list[Seen]:
        return [Seen(at, busy, serving > 0) for at, busy, serving in _ENTRY.iter_unpack(self.map)]

    def write(self, index: int, seen: Seen) -> None:
        _ENTRY.pack_into(self.map, _ENTRY.size * index, seen.at, seen.busy, float(seen.serving))

    def clear(self, index: int) -> None:
        self.write(index, Seen(0.0, 0.0, False))


def serves(index: int, seen: list[Seen], now: float, *, spill_at: float, serving: bool) -> bool:
    """Whether worker ``index`` takes new connections: the first always, another while each before it is full (past
    ``spill_at`` to start, ``STAY`` of it to go on)."""
    bound = spill_at * STAY if serving else spill_at
    return all(s.full(now, bound) for s in seen[:index])


def sheds(index: int, seen: list[Seen], now: float, *, spill_at: float) -> bool:
    """Whether worker ``index`` ends each connection after its answer: while it is past ``spill_at`` and the next
    worker takes connections and is not."""
    if index + 1 >= len(seen) or seen[index].busy < spill_at:
        return False
    after = seen[index + 1]
    return after.serving and not after.full(now, spill_at)


def listening_socket(host: str, port: int) -> socket.socket:
    """The API's socket, for every worker to accept on; raises OSError where it cannot be bound."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        bound_unsent(sock)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


@dataclass
class Turn:
    """A worker's place on the board, and the socket it shares."""

    index: int
    fd: int
    board: Board
    spill_at: float

    @classmethod
    def from_environment(cls, index: int, *, spill_at: float) -> Turn:
        return cls(index, int(os.environ[LISTEN_FD_ENV]), Board(Path(os.environ[BOARD_ENV])), spill_at)

    async def run(self, listen: Listen, server: Server) -> None:
        """Take connections (``listen`` on a copy of the socket) while ``serves`` says so; until cancelled."""
        listening: asyncio.AbstractServer | None = None
        cpu, wall = time.process_time(), time.monotonic()
        busy = 0.0
        try:
            while True:
                now = time.monotonic()
                seen = self.board.read()
                serving = serves(self.index, seen, now, spill_at=self.spill_at, serving=listening is not None)
                if serving and listening is None:
                    listening = await listen(socket.socket(fileno=os.dup(self.fd)))
                    log.info("gateway.taking_connections", worker=self.index)
                elif not serving and listening is not None:
                    listening.close()
                    listening = None
                    log.info("gateway.leaving_connections", worker=self.index)
                seen[self.index] = Seen(now, busy, serving)
                self.board.write(self.index, seen[self.index])
                server.shedding = sheds(self.index, seen, now, spill_at=self.spill_at)
                await asyncio.sleep(TICK_S)
                used, at = time.process_time(), time.monotonic()
                busy = (used - cpu) / max(at - wall, 1e-3)
                cpu, wall = used, at
        finally:
            self.board.clear(self.index)
            if listening is not None:
                listening.close()
