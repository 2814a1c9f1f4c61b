"""The gateway's health checks against ready URLs on 127.0.0.1 that answer, refuse, hang, cut or talk nonsense."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
from structlog.testing import capture_logs

from gateway.backends import Backend, Pool, check_ready, health_checker
from gateway.metrics import GatewayMetrics
from simulate.fakes.processes import free_port
from spotdrain.metrics import CollectorRegistry
from tests.conftest import until
from tests.integration.test_http1 import server

TIMEOUT_S = 0.3
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def pool_of(port: int, *, ready: bool) -> tuple[Pool, Backend]:
    pool = Pool([f"http://127.0.0.1:{port}"], GatewayMetrics.create(CollectorRegistry()))
    backend = pool.backends[0]
    backend.ready = ready
    return pool, backend


def answering(*pieces: bytes, heads: list[bytes] | None = None) -> Callable[[bytes], list[bytes]]:
    """``server``'s answer: ``pieces`` to every request (an empty one: a pause of 5 s), each request kept in
    ``heads``."""

    def answer(request: bytes) -> list[bytes]:
        if heads is not None:
            heads.append(request)
        return list(pieces)

    return answer


async def test_a_200_makes_a_backend_ready_and_the_request_asks_for_its_path_and_query_and_closes() -> None:
    heads: list[bytes] = []
    async with server(answering(OK, heads=heads)) as port:
        pool, backend = pool_of(port, ready=False)
        backend.ready_url = f"{backend.url}/ready?deep=1"
        await check_ready(pool, backend, timeout_s=TIMEOUT_S)
    assert backend.ready
    line, *fields = heads[0].decode().split("\r\n")
    assert line == "GET /ready?deep=1 HTTP/1.1"
    assert "Connection: close" in fields
    assert not any(f.lower().startswith("content-length") for f in fields)


@pytest.mark.parametrize(
    ("pieces", "detail"),
    [
        ([b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"], "HTTP 503"),  # the sidecar draining
        ([b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"], "HTTP 500"),
        ([b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 0\r\n\r\n"], "HTTP 429"),
        ([b"HTTP/1.1 301 Moved Permanently\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"], "HTTP 301"),
        ([b"SSH-2.0-OpenSSH_9.2\r\n\r\n"], "not an HTTP/1.1 status line"),  # not HTTP
        ([b"HTTP/1.1 200 OK\r\nContent-"], "closed before the answer's head"),  # cut inside the head
        ([], "closed before a byte of the answer"),
    ],
    ids=["503", "500", "429", "redirect", "not-http", "cut-head", "closed"],
)
async def test_anything_but_a_whole_200_head_makes_a_ready_backend_unready_and_says_why(
    pieces: list[bytes], detail: str
) -> None:
    async with server(answering(*pieces)) as port:
        pool, backend = pool_of(port, ready=True)
        with capture_logs() as logs:
            await check_ready(pool, backend, timeout_s=TIMEOUT_S)
    assert not backend.ready
    (unready,) = [e for e in logs if e["event"] == "backend.unready"]
    assert detail in unready["detail"], unready


async def test_a_ready_url_that_hangs_is_unready_within_the_timeout() -> None:
    heads: list[bytes] = []
    async with server(answering(b"", heads=heads)) as port:
        pool, backend = pool_of(port, ready=True)
        started = time.monotonic()
        with capture_logs() as logs:
            await check_ready(pool, backend, timeout_s=TIMEOUT_S)
        took = time.monotonic() - started
    assert heads, "the request reached the server"
    assert not backend.ready
    assert [e["detail"] for e in logs if e["event"] == "backend.unready"] == [f"no answer within {TIMEOUT_S} s"]
    assert TIMEOUT_S <= took < TIMEOUT_S + 0.5


async def test_a_backend_whose_port_refuses_turns_unready_and_ready_again_once_it_listens_again() -> None:
    port = free_port()
    pool, backend = pool_of(port, ready=True)
    checking = asyncio.create_task(health_checker(pool, interval_s=0.05, timeout_s=TIMEOUT_S))
    try:
        await until(lambda: not backend.ready, timeout_s=5)
        async with server(answering(OK), port=port):
            await until(lambda: backend.ready, timeout_s=5)
        await until(lambda: not backend.ready, timeout_s=5)
    finally:
        checking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await checking


async def test_a_break_asks_for_a_check_at_once_and_a_backend_that_turned_ready_is_found_within_the_pause() -> None:
    heads: list[bytes] = []
    async with server(answering(OK, heads=heads)) as port:
        pool, backend = pool_of(port, ready=False)
        checking = asyncio.create_task(health_checker(pool, interval_s=60, timeout_s=TIMEOUT_S))
        try:
            await until(lambda: len(heads) == 1, timeout_s=5)  # the first round; the next is a minute away
            backend.ready = False  # as a failed stream leaves it
            assert await pool.fresh(set(), within_s=1.0)
            assert len(heads) == 2
        finally:
            checking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checking
