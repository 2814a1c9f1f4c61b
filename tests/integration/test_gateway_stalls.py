"""A stream silent on a backend whose engine has just ended another stream with an error event moves on once past its
stall bound: vLLM 0.32.0, stopped, sends each stream's error event after logging a traceback, seconds apart on a busy
machine, its listener open all the while, so a probe finds it accepting. Once it closes its listener, its engine
has stopped: a stream silent there for half a second moves, whatever its own bound."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
from structlog.testing import capture_logs

from simulate.fakes.sse_client import Streamed, read_stream
from tests.gateway_harness import engines, gateway, metric, readiness, reference
from tests.integration.test_gateway_keepalive import forwarded, serving
from tests.integration.test_gateway_token_ids import COMPLETION, HEALTHY, USAGE, _hung, assert_same, hanging_engine

ERRING = dataclasses.replace(HEALTHY, fault="error", fault_after=7)


async def _posts(forwarder_posts: list[int], count: int) -> None:
    async with asyncio.timeout(5):
        while len(forwarder_posts) < count:
            await asyncio.sleep(0.01)


async def test_a_stream_silent_beside_one_that_got_an_error_event_continues_within_the_stall_bound() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    want = await reference(path, body)
    async with (
        hanging_engine() as (hung, _),
        engines(ERRING, HEALTHY) as (erring, healthy),
        forwarded(hung) as (forwarder, front),  # one backend URL: its first connection hangs, the next errs
        readiness(2) as (ready, urls),
    ):
        ready[1] = False  # both streams start on the front
        flags = ("--ready-url", urls[0], "--ready-url", urls[1], "--read-timeout", "30")
        async with gateway(front, healthy, flags=flags) as gw, aiohttp.ClientSession() as session:
            silent = await _hung(gw.url(path), body, session)
            forwarder.upstream = erring
            started = time.monotonic()
            erred = asyncio.create_task(read_stream(gw.url(path), body, session=session))
            await _posts(forwarder.posts, 2)
            ready[1] = True
            forwarder.upstream = hung  # a continuation sent back to the front is not whole from there
            got = await silent
            waited = time.monotonic() - started
            after_error = await erred
            causes = {
                cause: await metric(gw, f'spotdrain_gateway_continuations_total{{cause="{cause}"}}')
                for cause in ("stalled", "error_event", "timeout")
            }
    assert_same(got, want)
    assert_same(after_error, want)
    assert causes["error_event"] >= 1
    assert causes["stalled"] >= 1
    assert causes["timeout"] == 0
    assert waited < 3.0  # its stall bound and the watcher's interval, not a probe (it accepts) or the read timeout


async def test_a_stream_that_ends_whole_clears_the_error_and_a_silent_stream_then_stays() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    want = await reference(path, body)
    async with (
        hanging_engine() as (hung, _),
        engines(ERRING, HEALTHY) as (erring, healthy),
        forwarded(erring) as (forwarder, front),
        gateway(front) as gw,
        aiohttp.ClientSession() as session,
    ):
        erred = asyncio.create_task(read_stream(gw.url(path), body, session=session))
        await _posts(forwarder.posts, 1)
        forwarder.upstream = healthy  # its continuation, back on the only backend, ends whole
        assert_same(await erred, want)
        forwarder.upstream = hung
        forwarder.drop = {len(forwarder.posts)}  # the kept connection to the healthy engine: the request goes anew
        silent = await _hung(gw.url(path), body, session)
        with capture_logs() as logs:
            await asyncio.sleep(1.5)  # past its stall bound (0.5 s at this engine's pace) and the watcher's interval
        assert not silent.done()
        assert [e for e in logs if e["event"] == "gateway.moving"] == []
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="error_event"}') >= 1
        silent.cancel()


async def test_a_slow_stream_on_a_backend_that_refuses_connections_moves_after_half_a_second_of_silence() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    want = await reference(path, body)
    flags = ("--health-interval", "60")  # no health check in time to notice: the stall's own probe must
    async with (
        hanging_engine(tokens_per_s=2.0, fault_after=4) as (hung, site),  # gaps of 0.5 s: its own bound is 2 s
        engines(HEALTHY) as (healthy,),
        gateway(hung, healthy, flags=flags) as gw,
        aiohttp.ClientSession() as session,
    ):
        streamed = Streamed(0)
        running = asyncio.create_task(read_stream(gw.url(path), body, session=session, into=streamed))
        async with asyncio.timeout(5):
            while not streamed.arrivals:
                await asyncio.sleep(0.01)
        await site.stop()  # no new connection; the open stream goes on to its fourth token, then hangs
        got = await running
        stalled = await metric(gw, 'spotdrain_gateway_continuations_total{cause="stalled"}')
    assert_same(got, want)
    assert stalled == 1
    silence = max(b - a for a, b in zip(got.arrivals, got.arrivals[1:], strict=False))
    assert silence < 1.4  # half a second, the watcher's interval (0.2 s) and a probe, not the stream's 2 s bound


async def test_a_backend_that_refused_and_takes_connections_again_has_its_pauses_waited_for() -> None:
    """Restarted at the same address (its container, say), it takes the next stream's new connection: that stream's
    gaps of two thirds of a second are not stalls there, as they would be on a backend still refusing."""
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    short = {**body, "max_tokens": 4}
    want, want_short = await reference(path, body), await reference(path, short)
    slow = dataclasses.replace(HEALTHY, tokens_per_s=1.5)
    async with (
        hanging_engine() as (hung, _),
        engines(HEALTHY, slow) as (healthy, restarted),
        serving(hung) as (forwarder, front, server),
        readiness(2) as (ready, urls),
    ):
        ready[1] = False  # the first stream goes to the front
        flags = ("--ready-url", urls[0], "--ready-url", urls[1])
        async with gateway(front, healthy, flags=flags) as gw, aiohttp.ClientSession() as session:
            first = await _hung(gw.url(path), body, session)
            server.close()  # new connections refused; the hung stream's stays open
            ready[1] = True
            assert_same(await first, want)
            forwarder.upstream = restarted
            again = await asyncio.start_server(forwarder.handle, "127.0.0.1", front)
            ready[1] = False
            await asyncio.sleep(1.0)  # the health checks put the front back in rotation, and take the other out
            with capture_logs() as logs:
                second = await read_stream(gw.url(path), short, session=session)
            again.close()
            stalled = await metric(gw, 'spotdrain_gateway_continuations_total{cause="stalled"}')
    assert_same(second, want_short)
    assert stalled == 1  # the first stream's
    assert [e for e in logs if e["event"] == "gateway.moving"] == []
