"""The sidecar's loops in this process, against the fake engine and small servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest.mock import ANY

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from sidecar.main import run
from sidecar.record import DrainRecord, read_record, write_record
from sidecar.settings import from_arguments
from simulate.fakes.engine import EngineConfig
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, status_of, stream
from spotdrain.cli import build_parser
from tests.conftest import ask_drain, running_engine, scrape, until


class Sidecar:
    def __init__(self, port: int, drain_dir: Path, task: asyncio.Task[int]) -> None:
        self.port = port
        self.drain_dir = drain_dir
        self.task = task

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def metric(self, name: str) -> float | None:
        return await scrape(self.url + "/metrics", name)

    async def ready(self) -> int:
        return (await status_of(self.url + "/ready"))[0]

    async def wait_drained(self, timeout_s: float) -> None:
        async with asyncio.timeout(timeout_s):
            while not (self.drain_dir / "drained").exists():
                await asyncio.sleep(0.02)


@asynccontextmanager
async def sidecar(tmp_path: Path, engine_port: int, *flags: str) -> AsyncIterator[Sidecar]:
    """Run ``spotdrain sidecar`` in this loop; on leaving, SIGTERM ends it if the test has not."""
    port = free_port()
    argv: Sequence[str] = ["sidecar", "--host", "127.0.0.1", "--port", str(port), "--drain-dir", str(tmp_path)]
    # Short defaults that a test's own flags override (argparse keeps the last value).
    argv = [*argv, "--engine-url", f"http://127.0.0.1:{engine_port}", "--endpoint-delay", "0.1", "--drain-timeout", "2"]
    argv = [*argv, "--zero-confirm", "0.2"]
    argv = [*argv, *flags]
    ready = asyncio.Event()
    task = asyncio.create_task(run(from_arguments(build_parser().parse_args(argv)), ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 5)
    try:
        yield Sidecar(port, tmp_path, task)
    finally:
        if not task.done():
            os.kill(os.getpid(), signal.SIGTERM)
            await asyncio.wait_for(task, 15)


async def test_every_series_exists_from_start_at_zero(tmp_path: Path) -> None:
    async with running_engine(EngineConfig()) as engine, sidecar(tmp_path, engine) as car:
        assert await car.metric("spotdrain_sidecar_state") == 1
        for name in (
            "spotdrain_sidecar_in_flight",
            "spotdrain_sidecar_drains_total",
            "spotdrain_sidecar_streams_cut_total",
            "spotdrain_sidecar_read_errors_total",
            "spotdrain_sidecar_drain_duration_seconds_count",
            "spotdrain_sidecar_readiness_gate_errors_total",
            "spotdrain_sidecar_notice_errors_total",
            "spotdrain_sidecar_drain_record_errors_total",
        ):
            assert await car.metric(name) == 0, name
        assert (tmp_path / "prestop").exists()


async def test_ready_follows_the_engines_health(tmp_path: Path) -> None:
    async with running_engine(EngineConfig()) as engine:
        async with sidecar(tmp_path / "up", engine) as car:
            assert await car.ready() == 200
        # Another pod: the first one's drain directory records its drain, which a sidecar there would resume.
        nothing_there = free_port()
        async with sidecar(tmp_path / "down", nothing_there) as car:
            status, reason = await status_of(car.url + "/ready")
            unreachable = f"engine unreachable at http://127.0.0.1:{nothing_there}/health: ClientConnectorError"
            assert (status, reason.strip()) == (503, unreachable)


async def test_the_prestop_script_drains_the_pod_and_drained_comes_after_the_last_stream(tmp_path: Path) -> None:
    async with (
        running_engine(EngineConfig(tokens_per_s=100)) as engine,
        sidecar(tmp_path, engine, "--poll-interval", "0.1") as car,
    ):
        streams = [asyncio.create_task(stream(engine, max_tokens=n)) for n in (30, 60)]
        await asyncio.sleep(0.1)
        # As the kubelet runs it; no PATH, so no timer outlives the test.
        hook = await asyncio.create_subprocess_exec("/bin/sh", str(tmp_path / "prestop"), env={"PATH": ""})
        await until(lambda: car.task.done() or (tmp_path / "draining").exists(), timeout_s=5)
        assert await car.ready() == 503
        assert hook.returncode is None, "the preStop waits while streams run"
        assert read_record(tmp_path / "draining") == DrainRecord("prestop", ANY, None)
        results = await asyncio.gather(*streams)
        ended = asyncio.get_running_loop().time()
        assert [len(r) for r in results] == [31, 61]
        assert all(r[-1] == "[DONE]" for r in results)
        await car.wait_drained(2)
        assert asyncio.get_running_loop().time() - ended < 0.5
        assert await asyncio.wait_for(hook.wait(), 5) == 0
        assert not car.task.done(), "without SIGTERM the sidecar stays, drained"
        assert await car.metric('spotdrain_sidecar_drains_total{outcome="drained"}') == 1
        assert await car.metric("spotdrain_sidecar_drains_total") == 1
        assert await car.metric("spotdrain_sidecar_streams_cut_total") == 0
    assert car.task.result() == 0


async def notice_server(answers: list[tuple[int, str]]) -> tuple[web.AppRunner, str]:
    """A node agent's notice endpoint that gives ``answers`` in turn, then repeats the last."""

    async def notice(_: web.Request) -> web.Response:
        status, body = answers.pop(0) if len(answers) > 1 else answers[0]
        return web.Response(status=status, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/notice", notice)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}/v1/notice"


async def test_a_definitive_notice_drains_but_a_rebalance_recommendation_does_not(tmp_path: Path) -> None:
    rebalance = '{"id":"1","kind":"rebalance-recommendation","deadline":"2099-01-01T00:00:00Z","source":"imds"}'
    spot = '{"id":"2","kind":"spot-interruption","deadline":"2099-01-01T00:00:00Z","source":"imds"}'
    answers = [(204, ""), (500, "oops"), (200, rebalance), (200, rebalance), (200, spot)]
    runner, url = await notice_server(answers)
    try:
        async with running_engine(EngineConfig()) as engine:
            flags = ("--notice-url", url, "--poll-interval", "0.05")
            with capture_logs() as logs:
                async with sidecar(tmp_path, engine, *flags) as car:
                    await car.wait_drained(3)
                    assert await car.metric("spotdrain_sidecar_notice_errors_total") == 1
        started = [e for e in logs if e["event"] == "drain.started"]
        assert [e["reason"] for e in started] == ["notice:spot-interruption"]
    finally:
        await runner.cleanup()


async def metrics_server(status: int, body: str) -> tuple[web.AppRunner, int]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(status=status, text=body)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def test_an_unreadable_metrics_page_never_ends_a_drain_early(tmp_path: Path) -> None:
    for status, body, kind in ((500, "", "http"), (200, "garbage{{{", "missing")):
        runner, port = await metrics_server(status, body)
        try:
            flags = ("--poll-interval", "0.05", "--drain-timeout", "0.8")
            async with sidecar(tmp_path / kind, port, *flags) as car:
                started = asyncio.get_running_loop().time()
                ask_drain(car.drain_dir)
                await car.wait_drained(3)
                assert asyncio.get_running_loop().time() - started >= 0.7
                assert (await car.metric(f'spotdrain_sidecar_read_errors_total{{kind="{kind}"}}') or 0) >= 5
                assert await car.metric("spotdrain_sidecar_drains_total") == 1
        finally:
            await runner.cleanup()


async def test_a_gauge_stuck_after_clients_left_ends_as_a_stall(tmp_path: Path) -> None:
    async with running_engine(EngineConfig(tokens_per_s=50, leak_disconnected=True)) as engine:
        gone = asyncio.create_task(stream(engine, max_tokens=1000))
        await asyncio.sleep(0.2)
        gone.cancel()
        flags = ("--poll-interval", "0.05", "--stall-after", "0.5", "--drain-timeout", "20")
        with capture_logs() as logs:
            async with sidecar(tmp_path, engine, *flags) as car:
                ask_drain(tmp_path)
                await car.wait_drained(5)
        finished = [e for e in logs if e["event"] == "drain.finished"]
        assert finished[0]["outcome"] == "stalled"
        assert finished[0]["duration_s"] < 3


async def test_streams_longer_than_the_timeout_are_cut_and_counted(tmp_path: Path) -> None:
    async with running_engine(EngineConfig(tokens_per_s=20)) as engine:
        streams = [asyncio.create_task(stream(engine, max_tokens=400)) for _ in range(3)]
        await asyncio.sleep(0.2)
        flags = ("--poll-interval", "0.1", "--drain-timeout", "0.6")
        with capture_logs() as logs:
            async with sidecar(tmp_path, engine, *flags) as car:
                ask_drain(tmp_path)
                await car.wait_drained(3)
                assert await car.metric("spotdrain_sidecar_streams_cut_total") == 3
                assert await car.metric('spotdrain_sidecar_drains_total{outcome="timeout"}') == 1
        for task in streams:
            task.cancel()
        assert [e["streams_cut"] for e in logs if e["event"] == "drain.timeout"] == [3]


async def test_the_readiness_gate_is_true_while_serving_and_false_once_draining(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        kube.add_pod("ml", "vllm-0", node="gpu-1", readiness_gates=["spotdrain.io/serving"])
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")
        flags = ("--readiness-gate", "--pod-name", "vllm-0", "--serviceaccount-dir", str(account))

        def gate() -> str | None:
            pod = kube.pod("ml", "vllm-0") or {}
            found = [c for c in pod["status"].get("conditions", []) if c["type"] == "spotdrain.io/serving"]
            return found[0]["status"] if found else None

        async with running_engine(EngineConfig()) as engine, sidecar(tmp_path / "run", engine, *flags) as car:
            async with asyncio.timeout(5):
                while gate() != "True":
                    await asyncio.sleep(0.02)
            ask_drain(car.drain_dir)
            async with asyncio.timeout(5):
                while gate() != "False":
                    await asyncio.sleep(0.02)
            patches = [c for c in kube.calls if c.method == "PATCH"]
            assert {c.path for c in patches} == {"/api/v1/namespaces/ml/pods/vllm-0/status"}
            assert await car.metric("spotdrain_sidecar_readiness_gate_errors_total") == 0


async def test_a_gate_the_api_refuses_is_retried_counted_and_never_stops_the_sidecar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        kube.add_pod("ml", "vllm-0", node="gpu-1")
        kube.fail_next("PATCH", r"/status$", 503, count=2)
        kube.fail_next("PATCH", r"/status$", 403, count=1)
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")
        flags = ("--readiness-gate", "--pod-name", "vllm-0", "--serviceaccount-dir", str(account))
        with capture_logs() as logs:
            async with running_engine(EngineConfig()) as engine, sidecar(tmp_path / "run", engine, *flags) as car:
                async with asyncio.timeout(5):
                    while not any(e["event"] == "pod.readiness_gate_failed" for e in logs):
                        await asyncio.sleep(0.02)
                assert await car.metric("spotdrain_sidecar_readiness_gate_errors_total") == 3
                assert await car.ready() == 200
                assert not car.task.done()


async def test_a_resumed_drain_keeps_the_timeout_and_deadline_it_started_with(tmp_path: Path) -> None:
    # 1 s into its 2 s: the drain is still on when the restarted sidecar is first asked (with 1.5 s, a loaded
    # machine's start could reach the timeout first), and ended from this start it would take 3 s or more
    started = datetime.now(UTC) - timedelta(seconds=1.0)
    write_record(tmp_path / "draining", DrainRecord("notice:spot-interruption", started, None))
    async with running_engine(EngineConfig(tokens_per_s=20)) as engine:
        long = asyncio.create_task(stream(engine, max_tokens=400))
        await asyncio.sleep(0.2)
        with capture_logs() as logs:
            async with sidecar(tmp_path, engine, "--drain-timeout", "2", "--poll-interval", "0.05") as car:
                assert await car.ready() == 503
                assert await car.metric('spotdrain_sidecar_state{state="draining"}') == 1
                await car.wait_drained(1.5)
        long.cancel()
    timeouts = [e for e in logs if e["event"] == "drain.timeout"]
    assert len(timeouts) == 1
    assert 1.9 <= timeouts[0]["duration_s"] < 3, "2 s from the first sidecar's start, not from this one's"


async def test_an_unusable_drain_record_still_resumes_the_drain_and_is_counted(tmp_path: Path) -> None:
    (tmp_path / "draining").write_bytes(b"\x00{{not json")
    async with running_engine(EngineConfig()) as engine:
        with capture_logs() as logs:
            async with sidecar(tmp_path, engine, "--poll-interval", "0.05") as car:
                assert await car.ready() == 503
                assert await car.metric("spotdrain_sidecar_drain_record_errors_total") == 1
                await car.wait_drained(3)
    assert [e["reason"] for e in logs if e["event"] == "drain.started"] == ["resumed"]


async def test_a_zero_on_a_page_that_lags_the_engine_is_believed_only_across_the_lag(tmp_path: Path) -> None:
    # As on Ray: the page comes from a metrics port no client connects to, and shows the engine as it was 1 s ago.
    metrics_port = free_port()
    config = EngineConfig(tokens_per_s=50, report_delay_s=1.0, metrics_port=metrics_port)
    async with running_engine(config) as engine:
        flags = ("--engine-url", f"http://127.0.0.1:{metrics_port}", "--poll-interval", "0.05", "--zero-confirm", "1.5")
        async with sidecar(tmp_path, engine, *flags, "--drain-timeout", "10") as car:
            running = asyncio.create_task(stream(engine, max_tokens=60))  # 1.2 s, shown from 1 s on
            await asyncio.sleep(0.05)
            ask_drain(tmp_path)
            result = await running
            assert result[-1] == "[DONE]"
            assert not (tmp_path / "drained").exists(), "the page's stale zero ended the drain under a stream"
            await car.wait_drained(5)
            assert await car.metric('spotdrain_sidecar_drains_total{outcome="drained"}') == 1


async def test_a_client_still_receiving_buffered_bytes_after_the_gauge_dropped_holds_the_drain(tmp_path: Path) -> None:
    async with (
        running_engine(EngineConfig(tokens_per_s=2000)) as engine,
        sidecar(tmp_path, engine, "--poll-interval", "0.05", "--zero-confirm", "0", "--drain-timeout", "10") as car,
    ):
        client = socket.create_connection(("127.0.0.1", engine))
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = b'{"prompt": "hi", "max_tokens": 300, "stream": true}'
        head = b"POST /v1/completions HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
        client.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        ask_drain(tmp_path)
        running = "vllm:num_requests_running"
        # The engine is done within a fraction of a second; some 75 KB wait in the kernel for a client not reading.
        page = f"http://127.0.0.1:{engine}/metrics"
        async with asyncio.timeout(5):
            while await scrape(page, "vllm:generation_tokens_total") != 300 or await scrape(page, running) != 0:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)
        assert not (tmp_path / "drained").exists(), "the drain ended while the client had bytes still to read"
        client.setblocking(False)
        received = b""
        while b"[DONE]" not in received[-64:]:
            received += await asyncio.get_running_loop().sock_recv(client, 65536)
        await car.wait_drained(2)
        assert await car.metric('spotdrain_sidecar_drains_total{outcome="drained"}') == 1
        client.close()
