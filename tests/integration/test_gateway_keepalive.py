"""The gateway keeps its connection to an engine from one stream to the next, as the Rust routers do: streams one after
another reach the engine on one connection; a kept connection the engine closed while idle (its keep-alive timeout,
5 s on vLLM) is passed over, and one it closed as the request went is replaced, the stream whole either way and
never continued; a stream that did not end whole, and a backend out of rotation, leave no connection kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from gateway import keepalive
from gateway.keepalive import Kept
from simulate.fakes.engine import EngineConfig
from simulate.fakes.processes import free_port
from simulate.fakes.sse_client import Streamed, read_stream
from spotdrain.http1_reads import Reads
from tests.gateway_harness import FAST_TOKENS_PER_S, engines, gateway, readiness, reference

BODY: dict[str, Any] = {"prompt": "once upon a time", "max_tokens": 20}
HEALTHY = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S)


@dataclass
class Forwarder:
    """A TCP forwarder in front of an engine that notes which connection carried each POST, and closes those whose
    number is in ``drop`` unanswered: a server's idle close as the request arrives."""

    upstream: int  # where a new connection goes (a Service's choice of pod, which it may change)
    posts: list[int] = field(default_factory=list)  # for each POST, the number of its connection
    reached: list[int] = field(default_factory=list)  # for each POST, the upstream its connection went to
    drop: set[int] = field(default_factory=set)
    accepted: int = 0
    dead: bool = False  # set by ``die``: no byte passes either way, and no new connection is taken

    def die(self, server: asyncio.Server) -> None:
        """As a node that lost power: its connections stay open on this side and go silent, new ones are refused."""
        self.dead = True
        server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        number, upstream = self.accepted, self.upstream
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        back = asyncio.create_task(self._pump(up_reader, writer))
        try:
            while data := await reader.read(65536):
                if data.startswith(b"POST "):
                    self.posts.append(number)
                    self.reached.append(upstream)
                    if len(self.posts) - 1 in self.drop:
                        break
                if self.dead:
                    continue
                up_writer.write(data)
                await up_writer.drain()
        except ConnectionError:
            pass
        finally:
            up_writer.close()
            writer.close()
            back.cancel()
            with suppress(asyncio.CancelledError):
                await back

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(ConnectionError):
            while data := await reader.read(65536):
                if self.dead:
                    continue
                writer.write(data)
                await writer.drain()
        writer.close()  # the engine closed: so does the connection to the gateway


@asynccontextmanager
async def forwarded(upstream: int) -> AsyncIterator[tuple[Forwarder, int]]:
    async with serving(upstream) as (forwarder, port, _):
        yield forwarder, port


@asynccontextmanager
async def serving(upstream: int) -> AsyncIterator[tuple[Forwarder, int, asyncio.Server]]:
    forwarder = Forwarder(upstream)
    port = free_port()
    server = await asyncio.start_server(forwarder.handle, "127.0.0.1", port)
    try:
        yield forwarder, port, server
    finally:
        server.close()


async def streams(port: int, count: int, *, pause_s: float = 0.0) -> list[Streamed]:
    got = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for _ in range(count):
            got.append(await read_stream(f"http://127.0.0.1:{port}/v1/completions", BODY, session=session))
            await asyncio.sleep(pause_s)
    return got


def assert_whole(got: list[Streamed], want: Streamed) -> None:
    for streamed in got:
        assert streamed.status == 200
        assert streamed.text == want.text
        assert streamed.done == 1
        assert not streamed.cut


async def test_streams_one_after_another_reach_the_engine_on_one_connection() -> None:
    want = await reference("/v1/completions", BODY)
    async with engines(HEALTHY) as (engine,), forwarded(engine) as (forwarder, port), gateway(port) as gw:
        got = await streams(gw.port, 4)
    assert_whole(got, want)
    assert len(forwarder.posts) == 4
    assert len(set(forwarder.posts)) == 1


async def test_behind_one_url_a_kept_connection_is_not_taken_past_its_age_so_streams_follow_where_it_leads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(keepalive, "MAX_AGE_S", 0.5)
    async with engines(HEALTHY, HEALTHY) as (one, two), forwarded(one) as (service, port), gateway(port) as gw:
        await streams(gw.port, 1)
        service.upstream = two  # the Service now sends new connections to another pod
        await streams(gw.port, 1)  # on the kept connection, to the first
        await asyncio.sleep(0.6)
        await streams(gw.port, 1)  # past its age: a new connection
    assert service.reached == [one, one, two]


async def test_a_kept_connection_the_engine_closed_while_idle_is_passed_over() -> None:
    want = await reference("/v1/completions", BODY)
    closing = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S, keepalive_s=0.2)
    async with engines(closing) as (engine,), forwarded(engine) as (forwarder, port), gateway(port) as gw:
        with capture_logs() as logs:
            got = await streams(gw.port, 3, pause_s=0.6)
    assert_whole(got, want)
    assert len(forwarder.posts) == 3  # none sent on a connection already closed
    assert len(set(forwarder.posts)) == 3
    assert not [entry for entry in logs if entry["event"] in ("gateway.continued", "gateway.cut")]


async def test_a_kept_connection_closed_as_the_request_went_is_replaced_and_the_stream_is_not_continued() -> None:
    want = await reference("/v1/completions", BODY)
    async with engines(HEALTHY) as (engine,), forwarded(engine) as (forwarder, port), gateway(port) as gw:
        forwarder.drop = {1, 3}
        with capture_logs() as logs:
            got = await streams(gw.port, 3)
    assert_whole(got, want)
    first, dropped, again, dropped_again, last = forwarder.posts
    assert dropped == first  # the kept connection, closed unanswered
    assert again != first  # the request sent again, on a new one
    assert dropped_again == again
    assert last not in (first, again)
    assert not [entry for entry in logs if entry["event"] in ("gateway.continued", "gateway.cut")]


async def test_a_stream_sent_on_a_kept_connection_to_a_node_that_died_without_a_word_moves_within_seconds() -> None:
    want = await reference("/v1/completions", BODY)
    async with (
        engines(HEALTHY, HEALTHY) as (one, two),
        serving(one) as (dying, dying_port, server),
        forwarded(two) as (living, living_port),
        gateway(dying_port, living_port, flags=("--health-interval", "30")) as gw,
    ):
        await streams(gw.port, 2)  # one on each backend: each keeps its connection
        assert (len(dying.posts), len(living.posts)) == (1, 1)
        dying.die(server)
        started = time.monotonic()
        with capture_logs() as logs:
            (got,) = await streams(gw.port, 1)
        took = time.monotonic() - started
    assert_whole([got], want)
    assert len(dying.posts) == 2  # the last sent on the kept connection, never answered
    assert len(set(dying.posts)) == 1
    assert took < 4  # half a second of silence, a probe of 1 s at most (0.81 s), not the 60 s read timeout
    assert any(entry["event"] == "gateway.moving" and entry["cause"] == "stalled" for entry in logs)


async def test_a_stream_its_client_left_closes_its_connection_and_the_next_takes_a_new_one() -> None:
    want = await reference("/v1/completions", BODY)
    slow = EngineConfig(tokens_per_s=50)
    async with engines(slow) as (engine,), forwarded(engine) as (forwarder, port), gateway(port) as gw:
        async with aiohttp.ClientSession() as session:
            response = await session.post(f"{gw.url('/v1/completions')}", json={**BODY, "stream": True})
            await response.content.readuntil(b"\n\n")
            response.close()  # the client goes mid-stream
        await asyncio.sleep(0.3)
        got = await streams(gw.port, 1)
    assert_whole(got, want)
    assert len(forwarder.posts) == 2
    assert len(set(forwarder.posts)) == 2


async def test_a_backend_out_of_rotation_keeps_no_connection() -> None:
    async with (
        engines(HEALTHY) as (engine,),
        forwarded(engine) as (forwarder, port),
        readiness(1) as (ready, urls),
        gateway(port, flags=("--ready-url", urls[0])) as gw,
    ):
        await streams(gw.port, 1)
        ready[0] = False  # the engine's sidecar: draining
        await asyncio.sleep(0.6)  # health checks every 0.2 s
        ready[0] = True
        await asyncio.sleep(0.6)
        await streams(gw.port, 1)
    assert len(set(forwarder.posts)) == 2


@asynccontextmanager
async def connections(count: int) -> AsyncIterator[list[Reads]]:
    """``count`` open connections to a server that holds them, each as the gateway's reader has one."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    made = [(await loop.create_connection(Reads, "127.0.0.1", port))[1] for _ in range(count)]
    try:
        yield made
    finally:
        for protocol in made:
            assert protocol.transport is not None
            protocol.transport.close()
        server.close()


async def test_the_newest_idle_connection_is_taken_first_and_one_closed_meanwhile_is_passed_over() -> None:
    kept = Kept()
    async with connections(3) as (one, two, three):
        for protocol in (one, two, three):
            kept.keep(protocol)
        assert kept.take() is three
        assert two.transport is not None
        two.transport.close()
        assert kept.take() is one
        assert kept.take() is None
        kept.close()


async def test_past_the_most_kept_the_oldest_is_closed_and_each_is_closed_once_idle_too_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(keepalive, "MOST", 2)
    monkeypatch.setattr(keepalive, "IDLE_S", 0.1)
    kept = Kept()
    async with connections(3) as made:
        for protocol in made:
            kept.keep(protocol)
        assert [p.open for p in made] == [False, True, True]
        assert len(kept) == 2
        await asyncio.sleep(0.3)
        assert len(kept) == 0
        assert not any(p.open for p in made)
