"""Whatever the sidecar reads over HTTP, from real servers on 127.0.0.1, is counted and ignored, never fatal."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from sidecar.draining import drain_deadline
from sidecar.engine_client import EngineClient, engine_session
from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from sidecar.notices import NoticeError, notice_watcher, parse_notice
from sidecar.settings import DrainSettings, EngineSettings
from simulate.fakes.processes import free_port
from spotdrain.metrics import CollectorRegistry
from tests.conftest import serving_app
from tests.unit.test_notices import JSON, NOTICE_LIKE

SPOT = b'{"id":"2","kind":"spot-interruption","deadline":"2099-01-01T00:00:00Z","source":"imds"}'
Answer = tuple[int, bytes, str]  # status, body, content type
ANSWERS = st.tuples(
    st.sampled_from([200, 200, 200, 204, 500]),
    st.binary(max_size=200) | (JSON | NOTICE_LIKE).map(lambda value: json.dumps(value).encode()),
    st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain; charset=no-such-codec"]),
)


@asynccontextmanager
async def serving(path: str, answer: Callable[[], Answer]) -> AsyncIterator[str]:
    """A server on 127.0.0.1 whose ``path`` gives ``answer()`` each time; yields its base URL."""

    async def handle(_: web.Request) -> web.Response:
        status, body, content_type = answer()
        return web.Response(status=status, body=body if status != 204 else None, headers={"Content-Type": content_type})

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get(path, handle)
    app.router.add_get("/health", health)
    async with serving_app(app) as port:
        yield f"http://127.0.0.1:{port}"


def _rejected(status: int, body: bytes) -> bool:
    try:
        parse_notice(status, body)
    except NoticeError:
        return True
    return False


async def _watch(answers: list[Answer]) -> tuple[Lifecycle, SidecarMetrics]:
    queue = [*answers, (200, SPOT, "application/json")]
    metrics = SidecarMetrics.create(CollectorRegistry())
    lifecycle = Lifecycle(metrics)
    async with (
        serving("/v1/notice", lambda: queue.pop(0) if len(queue) > 1 else queue[0]) as url,
        aiohttp.ClientSession() as session,
    ):
        watch = notice_watcher(session, url + "/v1/notice", lifecycle, metrics, interval_s=0.001, wait_s=30)
        await asyncio.wait_for(watch, 10)
    return lifecycle, metrics


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ANSWERS, max_size=6))
def test_the_watcher_outlives_any_answer_and_still_drains_on_the_notice_after(answers: list[Answer]) -> None:
    lifecycle, metrics = asyncio.run(_watch(answers))
    # The first definitive notice drains: the generated one, if any parsed as such, else the real one after them.
    assert lifecycle.drain_asked.is_set()
    assert lifecycle.reason is not None
    assert lifecycle.reason.startswith("notice:")
    until = next((i for i, a in enumerate(answers) if not _rejected(a[0], a[1]) and parse_notice(a[0], a[1])), None)
    seen = answers if until is None else answers[:until]
    assert metrics.notice_errors._value.get() == sum(_rejected(status, body) for status, body, _ in seen)


async def test_a_notice_dated_year_one_is_counted_ignored_and_logged_once() -> None:
    bad = b'{"id":"1","kind":"spot-interruption","deadline":"0001-01-01T00:00:00+01:00","source":"imds"}'
    with capture_logs() as logs:
        lifecycle, metrics = await _watch([(200, bad, "application/json")] * 5)
    assert metrics.notice_errors._value.get() == 5
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["notice.poll_failed"]
    assert lifecycle.notice_deadline == datetime(2099, 1, 1, tzinfo=UTC)


def test_a_notice_deadline_at_the_start_of_time_ends_the_drain_at_once_without_overflow() -> None:
    lifecycle = Lifecycle(SidecarMetrics.create(CollectorRegistry()))
    lifecycle.ask_drain("notice:spot-interruption", deadline=datetime(1, 1, 1, 0, 0, 5, tzinfo=UTC))
    settings_ = DrainSettings(
        dir=Path("/nonexistent"),
        timeout_s=110,
        endpoint_delay_s=5,
        poll_interval_s=0.5,
        stall_after_s=15,
        zero_confirm_s=1,
        notice_url=None,
        notice_wait_s=30,
    )
    assert drain_deadline(lifecycle, settings_, 100.0) == 100.0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ANSWERS, min_size=1, max_size=4))
def test_the_engine_reader_outlives_any_metrics_page(answers: list[Answer]) -> None:
    async def read_all() -> list[int | None]:
        queue = list(answers)
        metrics = SidecarMetrics.create(CollectorRegistry())
        async with serving("/metrics", lambda: queue.pop(0)) as url, engine_session() as session:
            engine = EngineClient(session, EngineSettings("vllm", url, None, None, "/health"), metrics)
            return [(await engine.read()).in_flight for _ in answers]

    for value in asyncio.run(read_all()):
        assert value is None or value >= 0


async def test_a_metrics_page_in_a_charset_python_does_not_know_is_read_as_utf8() -> None:
    page = b'vllm:num_requests_running{engine="0"} 3 # {trace_id="\xff"} 0\n'
    metrics = SidecarMetrics.create(CollectorRegistry())
    async with (
        serving("/metrics", lambda: (200, page, "text/plain; charset=no-such-codec")) as url,
        engine_session() as session,
    ):
        engine = EngineClient(session, EngineSettings("vllm", url, None, None, "/health"), metrics)
        assert (await engine.read()).in_flight == 3


async def test_an_engine_it_cannot_reach_is_logged_once_with_the_url_it_tried() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    metrics = SidecarMetrics.create(CollectorRegistry())
    async with engine_session() as session:
        engine = EngineClient(session, EngineSettings("vllm", url, None, None, "/health"), metrics)
        with capture_logs() as logs:
            answers = [await engine.healthy() for _ in range(3)]
            await engine.read()
    assert set(answers) == {(False, f"engine unreachable at {url}/health: ClientConnectorError")}
    said = [e for e in logs if e["event"] != "engine.connections_judged"]  # where connections are read from
    assert [(e["event"], e["url"]) for e in said] == [
        ("engine.unhealthy", f"{url}/health"),
        ("engine.read_failed", f"{url}/metrics"),
    ]


async def test_an_engine_that_comes_up_is_logged_healthy_once() -> None:
    status = [503]
    metrics = SidecarMetrics.create(CollectorRegistry())
    async with serving("/health-of-test", lambda: (status[0], b"", "text/plain")) as url, engine_session() as session:
        engine = EngineClient(session, EngineSettings("vllm", url, None, None, "/health-of-test"), metrics)
        with capture_logs() as logs:
            assert await engine.healthy() == (False, "engine health answered HTTP 503")
            status[0] = 200
            assert [await engine.healthy() for _ in range(2)] == [(True, "ok")] * 2
    assert [e["event"] for e in logs] == ["engine.unhealthy", "engine.healthy"]
