"""Workers taking connections in turn on one socket (gateway.spill), on 127.0.0.1: two servers of one event loop stand
for two workers, each with its copy of the socket, one board between them. The first takes every connection while
it has room; the second takes them once the first is past ``--spill-at`` or not heard from, and leaves them when
the first has room again; a connection made meanwhile waits in the backlog and is served, not refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from gateway import spill
from gateway.request import Request
from gateway.server import Connection, Server, serve
from gateway.spill import Board, Seen, Turn, listening_socket
from tests.conftest import until

TICK_S = 0.05


def a_server(index: int) -> Server:
    """Echoes the body, after the index of the worker that took it."""

    async def echo(request: Request, connection: Connection) -> None:
        body = b"%d:%b" % (index, request.body)
        connection.answer(web.Response(status=200, body=body, headers={"Content-Type": "text/plain"}))

    return Server(echo, refused=lambda status: None, max_body_bytes=1000, body_timeout_s=5.0)


async def ask(port: int, body: bytes, *, timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST / HTTP/1.1\r\nHost: gw\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        return await asyncio.wait_for(reader.readexactly(len(body) + 2), timeout_s)
    finally:
        writer.close()


@asynccontextmanager
async def workers(tmp_path: Path, indices: list[int]) -> AsyncIterator[tuple[int, Board]]:
    """A server for each of ``indices`` (of two workers) on one shared socket; the board, for the test to write the
    entry of a worker it plays itself."""
    sock = listening_socket("127.0.0.1", 0)
    board = Board.create(tmp_path / "board", 2)
    servers = [a_server(i) for i in indices]
    tasks = [
        asyncio.create_task(
            serve(s, host="127.0.0.1", port=0, ready_flag=None, turn=Turn(i, sock.fileno(), board, spill_at=0.5))
        )
        for i, s in zip(indices, servers, strict=True)
    ]
    try:
        yield sock.getsockname()[1], board
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.close()


@pytest.fixture(autouse=True)
def quick_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill, "TICK_S", TICK_S)


async def test_the_first_worker_takes_every_connection_while_it_has_room(tmp_path: Path) -> None:
    async with workers(tmp_path, [0, 1]) as (port, board):
        await until(lambda: all(not s.stale(time.monotonic()) for s in board.read()), timeout_s=5)
        await asyncio.sleep(3 * TICK_S)  # the second has looked at the board since
        answers = await asyncio.gather(*(ask(port, b"%d" % n) for n in range(10)))
        assert answers == [b"0:%d" % n for n in range(10)]
        assert [s.serving for s in board.read()] == [True, False]


async def test_the_second_takes_connections_while_the_first_is_full_or_gone_and_leaves_them_after(
    tmp_path: Path,
) -> None:
    async with workers(tmp_path, [1]) as (port, board):  # the test plays the first worker

        def first(busy: float) -> None:
            board.write(0, Seen(time.monotonic(), busy, True))

        first(0.1)
        await until(lambda: board.read()[1].at > 0, timeout_s=5)
        assert not board.read()[1].serving
        waiting = asyncio.create_task(ask(port, b"queued"))  # no worker takes it: it waits in the backlog
        await asyncio.sleep(5 * TICK_S)
        assert not waiting.done()
        for busy in (0.9, 0.9):  # past --spill-at: the second takes connections, the waiting one first
            first(busy)
            await asyncio.sleep(TICK_S)
        assert await asyncio.wait_for(waiting, 5) == b"1:queued"
        assert board.read()[1].serving

        for _ in range(4):  # under STAY of --spill-at: it leaves them
            first(0.1)
            await asyncio.sleep(TICK_S)
        await until(lambda: not board.read()[1].serving, timeout_s=5)

        board.clear(0)  # the first worker died (its parent clears its entry): the second takes them at once
        assert await ask(port, b"after") == b"1:after"
        assert board.read()[1].serving
