"""The simulation's load generator against a router on 127.0.0.1: what it counts as a stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from simulate.load import PACE_TOKENS, Load, Unpaced, pace
from simulate.router import POD_HEADER
from simulate.timeline import Kind, Outcome, Recorder
from tests.conftest import serving_app

Completions = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def loading(completions: Completions, *, slots: int, length_s: float) -> AsyncIterator[tuple[Load, Recorder]]:
    """A router on 127.0.0.1 answering ``/v1/completions`` with ``completions``, and a load of ``slots`` in front of
    it, each stream meant to last ``length_s`` at 20 tokens a second, with its recorder."""
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    recorder = Recorder(asyncio.get_running_loop().time)
    async with serving_app(app) as port:
        load = Load(
            f"http://127.0.0.1:{port}", recorder, slots=slots, length_s=lambda _: length_s, tokens_per_s=20, hops={}
        )
        yield load, recorder


async def test_the_load_numbers_streams_as_they_are_routed_and_refusals_apart() -> None:
    """Behind a router that routes three requests and then has no pod in rotation, as the simulation's does."""
    routed = [0]

    async def completions(request: web.Request) -> web.StreamResponse:
        if routed[0] == 3:
            return web.Response(status=503, text="no pod in rotation")
        routed[0] += 1
        response = web.StreamResponse(headers={POD_HEADER: "vllm-0"})
        await response.prepare(request)
        wanted = (await request.json())["max_tokens"]
        for _ in range(wanted):
            await response.write(b'data: {"choices":[{"text":" t"}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    async with loading(completions, slots=2, length_s=0.1) as (load, recorder):
        await load.run()
    streams = sorted(r.id for r in recorder.streams if r.outcome is not Outcome.REFUSED)
    refusals = sorted(r.id for r in recorder.streams if r.outcome is Outcome.REFUSED)
    assert (streams, refusals) == ([1, 2, 3], [1, 2])
    subjects = {e.subject for e in recorder.events if e.kind is Kind.REFUSED}
    assert subjects == {"new request"}


async def test_the_slots_first_streams_reach_the_router_one_after_another_in_slot_order() -> None:
    """The scenarios' stream lengths count on the router spreading the slots' first streams over the pods in slot
    order: each slot's first request comes only once the one before it has its head, however slow that head is."""
    events: list[tuple[str, int]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        slot = int((await request.json())["prompt"].split()[1])
        events.append(("asked", slot))
        if slot == 0:
            await asyncio.sleep(0.3)  # a head slow to come: the other slots' requests would come first
        response = web.StreamResponse(headers={POD_HEADER: f"vllm-{slot}"})
        await response.prepare(request)
        events.append(("answered", slot))
        await response.write(b'data: {"choices":[{"text":" t"}]}\n\ndata: [DONE]\n\n')
        return response

    async with loading(completions, slots=4, length_s=0.05) as (load, _):
        task = asyncio.create_task(load.run())
        while ("answered", 3) not in events:
            await asyncio.sleep(0.01)
        load.stopping.set()
        await asyncio.wait_for(task, 5)
    asked = [events.index(("asked", slot)) for slot in range(4)]
    answered = [events.index(("answered", slot)) for slot in range(4)]
    assert all(answered[slot - 1] < asked[slot] for slot in range(1, 4)), events


async def test_after_a_cut_stream_the_next_request_is_answered_not_lost_on_the_closed_connection() -> None:
    """The router ends a cut stream as a complete chunked answer without ``[DONE]`` and closes the connection: the
    slot's next request must reach the router (and be refused, no pod being left) rather than fail on that
    connection and pass for a stream cut on no pod."""
    served = [0]

    async def completions(request: web.Request) -> web.StreamResponse:
        served[0] += 1
        if served[0] > 1:
            return web.Response(status=503, text="no pod in rotation")
        response = web.StreamResponse(headers={POD_HEADER: "vllm-0"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"text":" t"}]}\n\n')
        response.force_close()  # as the router does once the engine has gone mid-stream
        return response

    for _ in range(20):  # the stale connection was reused only when its close had not been read yet
        served[0] = 0
        async with loading(completions, slots=1, length_s=1.0) as (load, recorder):
            await asyncio.wait_for(load.run(), 5)
        outcomes = [(r.outcome, r.pod) for r in recorder.streams]
        assert outcomes == [(Outcome.CUT, "vllm-0"), (Outcome.REFUSED, None)]


async def test_the_pace_is_the_slowest_streams_tokens_per_second_over_every_engine() -> None:
    """Two engines that pace themselves, one at 100 tokens a second and one at 25: the slowest stream's rate, each
    token counted by its id, and every engine asked."""
    asked: list[int] = []

    def engine(tokens_per_s: float) -> web.Application:
        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            asked.append(body["max_tokens"])
            assert body["ignore_eos"] is True  # the tiny model's end of sequence would end the measure early
            response = web.StreamResponse()
            await response.prepare(request)
            for token in range(body["max_tokens"]):
                await asyncio.sleep(1 / tokens_per_s)
                await response.write(b'data: {"choices":[{"text":"t","token_ids":[%d]}]}\n\n' % token)
            await response.write(b"data: [DONE]\n\n")
            return response

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        return app

    async with serving_app(engine(100)) as fast, serving_app(engine(25)) as slow:
        urls = [f"http://127.0.0.1:{fast}", f"http://127.0.0.1:{slow}"]
        rate = await pace(urls, streams=4)
    assert asked == [PACE_TOKENS] * 4
    assert 5 < rate <= 25  # not the fast engine's, nor an average


async def test_an_engine_that_does_not_answer_in_time_leaves_the_pace_unmeasured() -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(1)  # past the pace's timeout
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving_app(app) as port:
        with pytest.raises(TimeoutError):
            await pace([f"http://127.0.0.1:{port}"], streams=2, timeout_s=0.2)


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (b"<html>a proxy's page</html>", Unpaced),  # a 200 that carries no token
        (b"data: [DONE]\n\n", Unpaced),
        (b'data: {"choices":[{"text":"t","token_ids":[1]}]}\n\n', Unpaced),  # ended without its [DONE]
        (b'data: {"choices":[{"text":"t","token_ids":[1]}]}\n\ncut', aiohttp.ClientPayloadError),  # dropped
    ],
)
async def test_an_engine_whose_stream_says_nothing_of_its_rate_leaves_the_pace_unmeasured(
    answer: bytes, raised: type[Exception]
) -> None:
    async def completions(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        if answer.endswith(b"cut"):
            response.content_length = 10 * len(answer)  # promised, then the connection closes short of it
        await response.prepare(request)
        await response.write(answer)
        if answer.endswith(b"cut"):
            assert request.transport is not None
            request.transport.close()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving_app(app) as port:
        with pytest.raises(raised):
            await pace([f"http://127.0.0.1:{port}"], streams=2, timeout_s=5)
