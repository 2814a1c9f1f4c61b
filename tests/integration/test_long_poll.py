"""The notice long poll against real servers on 127.0.0.1: the agent's board, an agent from before the long poll
(it answers at once, whatever ``wait`` says), and peers that hang or drop the connection.

Every wait here is on an event or a condition; the time guards only stop a test that would otherwise wait out a
60 s hold, and are far from anything a loaded machine takes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from agent.drain.board import NoticeBoard
from agent.notices.notice import Kind, Notice, Source
from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from sidecar.notices import notice_watcher
from simulate.fakes.processes import free_port
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import serve
from tests.conftest import serving_app

GUARD_S = 15.0  # well below the 60 s hold a missed wake-up would cost
SPOT = b'{"id":"n-9","kind":"spot-interruption","deadline":"2099-01-01T00:00:00Z","source":"imds"}'
REBALANCE = b'{"id":"r-1","kind":"rebalance-recommendation","deadline":"2099-01-01T00:00:00Z","source":"imds"}'


def notice(instance: str = "i-0123456789abcdef0", *, minutes: int = 2) -> Notice:
    deadline = datetime(2099, 1, 1, tzinfo=UTC) + timedelta(minutes=minutes)
    return Notice(kind=Kind.SPOT_INTERRUPTION, instance_id=instance, deadline=deadline, source=Source.IMDS)


@asynccontextmanager
async def board_serving(board: NoticeBoard, port: int | None = None) -> AsyncIterator[str]:
    """The board's app served as the agent serves it; yields the endpoint's URL."""
    port = port or free_port()
    ready = asyncio.Event()
    task = asyncio.create_task(serve(board.app(), host="127.0.0.1", port=port, ready_flag=ready, name="notices"))
    await ready.wait()
    try:
        yield f"http://127.0.0.1:{port}/v1/notice"
    finally:
        task.cancel()
        await asyncio.wait([task])


async def until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.005)


async def get(session: aiohttp.ClientSession, url: str, **query: str) -> tuple[int, str]:
    async with session.get(url, params=query) as response:
        return response.status, await response.text()


async def held(
    board: NoticeBoard, session: aiohttp.ClientSession, url: str, held_for: str, **query: str
) -> asyncio.Task[tuple[int, str]]:
    """A request sent, and held by the board for node ``held_for`` (not merely sent), before this returns."""
    node = held_for
    before = board.waiting(node)
    request = asyncio.create_task(get(session, url, **query))
    await until(lambda: board.waiting(node) > before or request.done())
    assert not request.done(), request.result()
    return request


# The agent's side ----------------------------------------------------------------------------------------------------


async def test_a_held_request_is_answered_the_moment_a_notice_is_published() -> None:
    board, spot = NoticeBoard(local_node="gpu-1"), notice()
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        request = await held(board, session, url, "gpu-1", wait="60")
        board.publish("gpu-1", spot)
        status, body = await request
    assert status == 200
    assert spot.id in body
    assert board.waiting("gpu-1") == 0


async def test_with_a_notice_on_the_board_a_request_without_after_answers_at_once() -> None:
    board, spot = NoticeBoard(local_node="gpu-1"), notice()
    board.publish("gpu-1", spot)
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        status, body = await get(session, url, wait="60")
    assert (status, spot.id in body) == (200, True)


async def test_without_wait_the_endpoint_answers_at_once_as_it_always_has() -> None:
    board = NoticeBoard(local_node=None)
    async with board_serving(board) as url, aiohttp.ClientSession() as session:
        assert (await get(session, url, node="gpu-1"))[0] == 204
        assert (await get(session, url))[0] == 400, "queue mode: the node must be named"
        assert (await get(session, url, node="gpu-1", wait="later"))[0] == 400
    assert board.waiting("gpu-1") == 0


async def test_after_the_current_notice_the_request_waits_and_a_withdrawal_answers_no_content() -> None:
    board, spot = NoticeBoard(local_node="gpu-1"), notice()
    board.publish("gpu-1", spot)
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        request = await held(board, session, url, "gpu-1", wait="60", after=spot.id)
        board.withdraw("gpu-1", spot)
        assert (await request)[0] == 204


async def test_after_a_notice_withdrawn_since_the_answer_is_no_content_at_once() -> None:
    board, spot = NoticeBoard(local_node="gpu-1"), notice()
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        assert (await get(session, url, wait="60", after=spot.id))[0] == 204
    assert board.waiting("gpu-1") == 0


async def test_after_a_notice_replaced_since_the_answer_is_the_new_one() -> None:
    board, later, sooner = NoticeBoard(local_node="gpu-1"), notice(minutes=5), notice(minutes=1)
    board.publish("gpu-1", later)
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        request = await held(board, session, url, "gpu-1", wait="60", after=later.id)
        board.publish("gpu-1", notice(minutes=9))  # a later deadline changes nothing: still held
        assert board.waiting("gpu-1") == 1
        board.publish("gpu-1", sooner)
        status, body = await request
        assert (status, sooner.id in body) == (200, True)
        board.publish("gpu-1", later)  # and the board still shows the sooner one to a late-comer after the later
        status, body = await get(session, url, wait="60", after=later.id)
        assert (status, sooner.id in body) == (200, True)


async def test_a_held_request_answers_what_is_known_when_its_wait_ends() -> None:
    board, spot = NoticeBoard(local_node="gpu-1"), notice()
    async with board_serving(board) as url, aiohttp.ClientSession() as session:
        assert (await get(session, url, wait="0.05"))[0] == 204
        board.publish("gpu-1", spot)
        status, body = await get(session, url, wait="0.05", after=spot.id)
        assert (status, spot.id in body) == (200, True)
    assert board.waiting("gpu-1") == 0


async def test_a_notice_for_one_node_leaves_the_other_nodes_requests_held() -> None:
    board, spot = NoticeBoard(local_node=None), notice()
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        other = await held(board, session, url, "gpu-1", node="gpu-1", wait="60")
        mine = await held(board, session, url, "gpu-2", node="gpu-2", wait="60")
        board.publish("gpu-2", spot)
        assert (await mine)[0] == 200
        assert not other.done()
        assert board.waiting("gpu-1") == 1
        board.publish("gpu-1", notice("i-0fedcba9876543210"))
        assert (await other)[0] == 200


async def test_two_thousand_held_requests_are_released_by_one_publish_and_one_withdrawal() -> None:
    board, spot, count = NoticeBoard(local_node=None), notice(), 2000
    connector = aiohttp.TCPConnector(limit=0)
    async with (
        board_serving(board) as url,
        aiohttp.ClientSession(connector=connector) as session,
        asyncio.timeout(GUARD_S * 4),
    ):
        requests = [asyncio.create_task(get(session, url, node="gpu-1", wait="60")) for _ in range(count)]
        await until(lambda: board.waiting("gpu-1") == count)
        board.publish("gpu-1", spot)
        answers = await asyncio.gather(*requests)
        assert {status for status, _ in answers} == {200}
        assert all(spot.id in body for _, body in answers)
        requests = [
            asyncio.create_task(get(session, url, node="gpu-1", wait="60", after=spot.id)) for _ in range(count)
        ]
        await until(lambda: board.waiting("gpu-1") == count)
        board.withdraw("gpu-1", spot)
        assert {status for status, _ in await asyncio.gather(*requests)} == {204}
    assert board.waiting("gpu-1") == 0


async def test_the_board_renders_a_notice_once_however_many_requests_it_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rendered: list[str] = []
    public = Notice.public

    def counted(self: Notice) -> dict[str, str]:
        rendered.append(self.id)
        return public(self)

    monkeypatch.setattr(Notice, "public", counted)
    board, spot = NoticeBoard(local_node="gpu-1"), notice()
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        waiting = [await held(board, session, url, "gpu-1", wait="60") for _ in range(3)]
        board.publish("gpu-1", spot)
        answers = [await request for request in waiting] + [await get(session, url) for _ in range(3)]
    assert answers == [(200, json.dumps(public(spot)))] * 6
    assert rendered == [spot.id], "rendered at the publish, not once per answer: all the node's sidecars ask at once"


async def test_a_stopping_agent_answers_its_held_requests_instead_of_waiting_them_out() -> None:
    board = NoticeBoard(local_node="gpu-1")
    async with aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        async with board_serving(board) as url:
            request = await held(board, session, url, "gpu-1", wait="60")
        assert (await request)[0] == 204


# The sidecar's side --------------------------------------------------------------------------------------------------


def sidecar() -> tuple[Lifecycle, SidecarMetrics]:
    metrics = SidecarMetrics.create(CollectorRegistry())
    return Lifecycle(metrics), metrics


async def test_a_published_notice_reaches_a_waiting_sidecar_at_once() -> None:
    board, spot = NoticeBoard(local_node=None), notice()
    async with board_serving(board) as url, aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        # Polling every 30 s could not see it inside the guard: only the held request can.
        lifecycle, metrics = sidecar()
        watch = notice_watcher(session, f"{url}?node=gpu-1", lifecycle, metrics, interval_s=30, wait_s=60)
        task = asyncio.create_task(watch)
        await until(lambda: board.waiting("gpu-1") == 1)
        with capture_logs() as logs:
            board.publish("gpu-1", spot)
            await task
    assert lifecycle.reason == "notice:spot-interruption"
    assert lifecycle.notice_deadline == spot.deadline
    assert metrics.notice_errors._value.get() == 0
    # Out of rotation before anything else, even the log line that says why: the node's sidecars all react at once.
    assert [e["event"] for e in logs] == ["drain.started", "notice.received"]


@asynccontextmanager
async def old_agent(answer: Callable[[], tuple[int, bytes]]) -> AsyncIterator[tuple[str, list[Mapping[str, str]]]]:
    """A notice endpoint from before the long poll: it answers at once, whatever ``wait`` asks; yields its URL and
    the query of every request it was sent."""
    queries: list[Mapping[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        queries.append(dict(request.query))
        status, body = answer()
        return web.Response(status=status, body=body if status == 200 else None, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/notice", handle)
    async with serving_app(app) as port:
        yield f"http://127.0.0.1:{port}/v1/notice", queries


async def test_against_an_agent_that_ignores_wait_the_sidecar_polls_at_the_interval_and_still_drains() -> None:
    state = {"answer": (204, b"")}
    interval_s, polls = 0.05, 6
    with capture_logs() as logs:
        async with old_agent(lambda: state["answer"]) as (url, queries), aiohttp.ClientSession() as session:
            lifecycle, metrics = sidecar()
            watch = notice_watcher(session, url, lifecycle, metrics, interval_s=interval_s, wait_s=30)
            task = asyncio.create_task(watch)
            began = asyncio.get_running_loop().time()
            async with asyncio.timeout(GUARD_S):
                await until(lambda: len(queries) >= polls)
            # Each answer came at once: had the sidecar asked again at once, these would have taken milliseconds.
            assert asyncio.get_running_loop().time() - began >= (polls - 1) * interval_s
            state["answer"] = (200, SPOT)
            async with asyncio.timeout(GUARD_S):
                await task
    assert all(query == {"wait": "30"} for query in queries)
    assert lifecycle.reason == "notice:spot-interruption"
    assert metrics.notice_errors._value.get() == 0
    assert [e["event"] for e in logs if e["event"].startswith("notice.")] == ["notice.polling", "notice.received"]


async def test_the_sidecar_waits_after_a_notice_it_does_not_drain_for() -> None:
    async with old_agent(lambda: (200, REBALANCE)) as (url, queries), aiohttp.ClientSession() as session:
        lifecycle, metrics = sidecar()
        watch = notice_watcher(session, url, lifecycle, metrics, interval_s=0.01, wait_s=30)
        task = asyncio.create_task(watch)
        async with asyncio.timeout(GUARD_S):
            await until(lambda: len(queries) >= 3)
        task.cancel()
        await asyncio.wait([task])
    assert queries[0] == {"wait": "30"}
    assert queries[1] == queries[2] == {"wait": "30", "after": "r-1"}
    assert not lifecycle.drain_asked.is_set()


async def test_the_sidecar_rides_out_an_agent_restart_and_drains_on_the_new_agents_notice() -> None:
    first, spot, port = NoticeBoard(local_node="gpu-1"), notice(), free_port()
    async with aiohttp.ClientSession() as session, asyncio.timeout(GUARD_S):
        async with board_serving(first, port) as url:
            lifecycle, metrics = sidecar()
            watch = notice_watcher(session, url, lifecycle, metrics, interval_s=0.05, wait_s=60)
            task = asyncio.create_task(watch)
            await until(lambda: first.waiting("gpu-1") == 1)
        await asyncio.sleep(0.2)  # the sidecar asks while nothing listens
        second = NoticeBoard(local_node="gpu-1")
        async with board_serving(second, port):
            await until(lambda: second.waiting("gpu-1") == 1)
            second.publish("gpu-1", spot)
            await task
    assert lifecycle.reason == "notice:spot-interruption"


@asynccontextmanager
async def scripted_peer(script: list[bytes | None]) -> AsyncIterator[str]:
    """A TCP peer that, on its n-th connection, reads the request and then writes ``script[n]`` and closes, or
    never answers (None); the last entry repeats. Yields its URL."""
    hung: list[asyncio.StreamWriter] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        step = script.pop(0) if len(script) > 1 else script[0]
        await reader.readuntil(b"\r\n\r\n")
        if step is None:
            hung.append(writer)
            return
        writer.write(step)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1/notice"
    finally:
        for writer in hung:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


def http_200(body: bytes) -> bytes:
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def test_a_hung_agent_and_a_connection_dropped_mid_answer_are_counted_and_asked_again() -> None:
    cut = http_200(SPOT)[:-20]
    async with scripted_peer([None, cut, http_200(SPOT)]) as url, aiohttp.ClientSession() as session:
        # A hang is given up at the wait plus a second, then an answer cut short, then the notice.
        lifecycle, metrics = sidecar()
        watch = notice_watcher(session, url, lifecycle, metrics, interval_s=0.01, wait_s=0.1)
        with capture_logs() as logs:
            async with asyncio.timeout(GUARD_S):
                await watch
    assert metrics.notice_errors._value.get() == 2
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["notice.poll_failed"]
    assert lifecycle.reason == "notice:spot-interruption"
