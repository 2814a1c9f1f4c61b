"""``spotdrain gateway --workers 2`` as a real process tree: the workers share the parent's socket, the first takes
the connections of a light load, a worker killed with SIGKILL is started again while the other takes its new
connections, and /metrics adds every worker up, the dead one's counts included."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from gateway.spill import BOARD_ENV, Board
from simulate.fakes.processes import engine_args, free_port, start, status_of, wait_http
from simulate.fakes.sse_client import Streamed, read_stream

pytestmark = pytest.mark.e2e

BODY = {"prompt": "hello", "max_tokens": 20}


@dataclass
class Tree:
    gateway: asyncio.subprocess.Process
    port: int
    metrics_port: int

    def workers(self) -> set[int]:
        found: set[int] = set()
        for task in Path(f"/proc/{self.gateway.pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                found |= {int(pid) for pid in (task / "children").read_text().split()}
        return found

    def worker(self, index: int) -> int:
        """The pid of the worker ``index`` (from its environment)."""
        mark = f"SPOTDRAIN_GATEWAY_WORKER={index}".encode()
        return next(pid for pid in self.workers() if mark in _environment(pid))

    def board(self) -> Board:
        """The workers' board (gateway.spill), where a worker's environment says it is."""
        mark = BOARD_ENV.encode() + b"="
        found = next(v for v in _environment(self.worker(0)) if v.startswith(mark))
        return Board(Path(found.removeprefix(mark).decode()))

    def accepted(self, pid: int) -> int:
        """How many of the clients' connections process ``pid`` holds (its sockets on the API port, from
        /proc/net/tcp: local port, state 01 ESTABLISHED, inode)."""
        inodes = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(FileNotFoundError):
                inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
        return sum(1 for r in _tcp_rows(self.port) if r[3] == "01" and r[9] in inodes)

    async def metric(self, sample: str) -> float:
        _, page = await status_of(f"http://127.0.0.1:{self.metrics_port}/metrics")
        return next(float(line.split()[-1]) for line in page.splitlines() if line.startswith(sample + " "))

    async def streams(self, count: int, body: dict[str, object] = BODY) -> list[Streamed]:
        """``count`` streams at once, each on a connection of its own (so the kernel spreads them over workers)."""
        url = f"http://127.0.0.1:{self.port}/v1/completions"
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            return list(await asyncio.gather(*(read_stream(url, body, session=session) for _ in range(count))))


def _environment(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


async def until(condition: object, *, within_s: float = 15.0) -> None:
    async with asyncio.timeout(within_s):
        while not await condition():  # type: ignore[operator]
            await asyncio.sleep(0.05)


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[Tree]:
    engine_port, port, metrics_port = free_port(), free_port(), free_port()
    engine = await start(engine_args(engine_port, "--tokens-per-second", "20"), log_path=tmp_path / "engine.log")
    argv = ["-m", "spotdrain.cli", "--log-format", "json", "gateway", "--host", "127.0.0.1", "--workers", "2"]
    argv += ["--port", str(port), "--metrics-port", str(metrics_port), "--health-interval", "0.2"]
    gateway = await start([*argv, "--backend", f"http://127.0.0.1:{engine_port}"], log_path=tmp_path / "gateway.log")
    tree = Tree(gateway, port, metrics_port)
    try:
        await wait_http(f"http://127.0.0.1:{engine_port}/health", status=200)
        await wait_http(f"http://127.0.0.1:{metrics_port}/ready", status=200, timeout_s=20)
        await until(lambda: _listening(port, 1))  # the parent's socket
        yield tree
    finally:
        workers = tree.workers() if gateway.returncode is None else set()
        for process in (gateway, engine):
            if process.returncode is None:
                process.kill()
                await process.wait()
        for pid in workers:  # the workers follow their parent out (PR_SET_PDEATHSIG); none may be left behind
            await until(lambda pid=pid: _gone(pid), within_s=5)


async def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return True
    return state == "Z"  # exited, not yet reaped by its parent


async def _listening(port: int, count: int) -> bool:
    """Whether ``count`` sockets listen on ``port``, from /proc/net/tcp (state 0A is LISTEN)."""
    return sum(1 for row in _tcp_rows(port) if row[3] == "0A") == count


def _tcp_rows(port: int) -> list[list[str]]:
    """The rows of /proc/net/tcp whose local port is ``port``, split into their fields."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [row for row in rows if row[1].endswith(f":{port:04X}")]


def whole(streams: list[Streamed]) -> list[Streamed]:
    return [s for s in streams if s.done == 1 and not s.cut and s.finish_reasons == ["length"]]


async def test_a_worker_killed_with_sigkill_is_started_again_and_the_counts_add_up_across_it(tree: Tree) -> None:
    first = tree.workers()
    assert len(first) == 2
    assert len(whole(await tree.streams(30, {**BODY, "max_tokens": 3}))) == 30
    assert await tree.metric('spotdrain_gateway_requests_total{outcome="completed"}') == 30

    killed, kept = sorted(first)
    os.kill(killed, signal.SIGKILL)
    await until(lambda: _replaced(tree, killed))
    assert kept in tree.workers()
    assert len(whole(await tree.streams(30, {**BODY, "max_tokens": 3}))) == 30
    # The killed worker's 30 (or its share of them) are still counted: the series never goes back.
    assert await tree.metric('spotdrain_gateway_requests_total{outcome="completed"}') == 60

    workers = tree.workers()
    tree.gateway.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(tree.gateway.wait(), 15) == 0
    for pid in workers:
        assert await _gone(pid)


async def _replaced(tree: Tree, killed: int) -> bool:
    workers = tree.workers()
    return killed not in workers and len(workers) == 2


async def test_the_first_worker_takes_a_light_loads_connections_and_the_other_takes_new_ones_when_it_is_killed(
    tree: Tree,
) -> None:
    first, second = tree.worker(0), tree.worker(1)
    board = tree.board()
    # Until both workers have looked: the second took connections while the first was starting.
    await until(lambda: _settled(board))
    running = asyncio.create_task(tree.streams(20))  # 20 tokens at 20 a second: a second each
    await until(lambda: _at_least(tree, "spotdrain_gateway_open_streams", 20))  # summed over both workers
    assert (tree.accepted(first), tree.accepted(second)) == (20, 0)
    os.kill(first, signal.SIGKILL)
    got = await running
    assert len([s for s in got if s.cut]) == 20
    # The parent drops the dead worker's series (its 20 open streams counted no more) and clears its entry, and the
    # other takes connections at its next look (half a second): none is refused meanwhile, they wait in the backlog.
    # The parent starts a new first worker too, at once (or a second later, for one that died within a second of its
    # start): the connections are all the other's where that one has not yet taken any (it says so before it can).
    await until(lambda: _at_most(tree, "spotdrain_gateway_open_streams", 0))
    running = asyncio.create_task(tree.streams(10))
    await until(lambda: _at_least(tree, "spotdrain_gateway_open_streams", 10))
    assert sum(tree.accepted(pid) for pid in tree.workers()) == 10
    if not board.read()[0].serving:
        assert tree.accepted(second) == 10
    assert len(whole(await running)) == 10
    await until(lambda: _at_most(tree, "spotdrain_gateway_open_streams", 0))


async def _settled(board: Board) -> bool:
    now = time.monotonic()
    return [(s.serving, s.stale(now)) for s in board.read()] == [(True, False), (False, False)]


async def _at_least(tree: Tree, sample: str, value: float) -> bool:
    return await tree.metric(sample) >= value


async def _at_most(tree: Tree, sample: str, value: float) -> bool:
    return await tree.metric(sample) <= value


async def test_the_workers_go_with_their_parent_when_it_is_killed(tree: Tree) -> None:
    workers = tree.workers()
    tree.gateway.kill()
    await tree.gateway.wait()
    for pid in workers:
        await until(lambda pid=pid: _gone(pid), within_s=5)
