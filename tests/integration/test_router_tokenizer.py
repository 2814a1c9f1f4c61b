"""The simulation's router passes vLLM's /tokenize and /detokenize to a pod in rotation, for the gateway continuing a
parsed chat; an engine that holds such a call is answered for within the router's timeout, not waited on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

import simulate.router as routing
from simulate.fakes.processes import free_port, wait_http
from simulate.probes import Answer
from simulate.router import Backend, Router
from simulate.timeline import Recorder
from tests.conftest import serving_app


async def ready(_: aiohttp.ClientSession) -> Answer:
    return True, "ready"


@asynccontextmanager
async def router_in_front_of(engine_port: int) -> AsyncIterator[str]:
    backend = Backend("vllm-0", f"http://127.0.0.1:{engine_port}", ready)
    router = Router([backend], Recorder(time.monotonic), poll_s=0.05)
    port = free_port()
    serving = asyncio.create_task(router.serve(port=port))
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", status=200, timeout_s=10)
        await asyncio.wait_for(router.all_ready.wait(), 5)
        yield f"http://127.0.0.1:{port}"
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


async def test_a_tokenizer_call_reaches_the_pod_and_its_answer_comes_back_as_it_was() -> None:
    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": [1, 2], "asked": await request.json()})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    async with (
        serving_app(app) as engine,
        router_in_front_of(engine) as url,
        aiohttp.ClientSession() as session,
        session.post(f"{url}/tokenize", json={"prompt": "<think>"}) as answer,
    ):
        assert answer.status == 200
        assert await answer.json() == {"tokens": [1, 2], "asked": {"prompt": "<think>"}}


async def test_an_engine_that_holds_a_tokenizer_call_is_answered_502_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(routing, "TOKENIZER_TIMEOUT_S", 0.3)

    released = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        await released.wait()  # until the test is done: the engine's server would wait for it as it stops
        return web.json_response({"tokens": [1]})

    app = web.Application()
    app.router.add_post("/detokenize", hang)
    async with serving_app(app) as engine, router_in_front_of(engine) as url, aiohttp.ClientSession() as session:
        started = time.monotonic()
        async with session.post(f"{url}/detokenize", json={"tokens": [1]}) as answer:
            assert answer.status == 502
            assert "unreachable" in (await answer.json())["error"]["message"]
        assert time.monotonic() - started < 2.0
        released.set()
