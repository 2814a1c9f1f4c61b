"""The real ``spotdrain sidecar`` process beside the fake engine process, driven by real signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import engine_args, free_port, sidecar_args, start, status_of, stream, wait_http
from tests.conftest import until

pytestmark = pytest.mark.e2e

POLL_S = 0.2
ZERO_CONFIRM_S = 0.3
# A reading lands within one poll interval of a stream's end; the zero is confirmed ZERO_CONFIRM_S later (a tenth
# of a poll interval at the soonest), and a Python process needs a few tens of milliseconds to exit.
EXIT_SLACK_S = POLL_S / 10 + 0.15


@dataclass
class Pod:
    engine_port: int
    sidecar_port: int
    drain_dir: Path
    engine: asyncio.subprocess.Process
    sidecar: asyncio.subprocess.Process
    sidecar_log: Path

    async def ready(self) -> int:
        return (await status_of(f"http://127.0.0.1:{self.sidecar_port}/ready"))[0]

    def log_events(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.sidecar_log.read_text().splitlines() if line.startswith("{")]


@pytest.fixture
async def pod(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Pod]:
    flags, engine_flags = getattr(request, "param", ((), ()))
    engine_port, sidecar_port = free_port(), free_port()
    engine = await start(
        engine_args(engine_port, "--tokens-per-second", "50", *engine_flags), log_path=tmp_path / "engine.log"
    )
    sidecar = await start(
        sidecar_args(
            port=sidecar_port,
            engine_port=engine_port,
            drain_dir=tmp_path / "drain",
            extra=[
                "--endpoint-delay",
                "0.3",
                "--poll-interval",
                str(POLL_S),
                "--zero-confirm",
                str(ZERO_CONFIRM_S),
                *flags,
            ],
        ),
        log_path=tmp_path / "sidecar.log",
    )
    try:
        await wait_http(f"http://127.0.0.1:{sidecar_port}/ready", status=200)
        yield Pod(engine_port, sidecar_port, tmp_path / "drain", engine, sidecar, tmp_path / "sidecar.log")
    finally:
        for process in (sidecar, engine):
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_sigterm_holds_termination_until_every_stream_has_completed(pod: Pod) -> None:
    lengths = (40, 70, 100)  # 0.8 s to 2 s at 50 tokens/s
    streams = [asyncio.create_task(stream(pod.engine_port, max_tokens=n)) for n in lengths]
    await asyncio.sleep(0.2)
    loop = asyncio.get_running_loop()
    pod.sidecar.send_signal(signal.SIGTERM)
    sent = loop.time()
    while await pod.ready() != 503:
        await asyncio.sleep(0.01)
    assert loop.time() - sent < 0.5

    results = await asyncio.gather(*streams)
    last_ended = loop.time()
    assert pod.sidecar.returncode is None, "the sidecar must stay up while streams run"
    assert [r[-1] for r in results] == ["[DONE]"] * 3
    assert [len(r) - 1 for r in results] == list(lengths)
    assert results[2][:40] == results[0][:40]  # same prompt, same tokens: nothing lost or reordered

    assert await asyncio.wait_for(pod.sidecar.wait(), 3) == 0
    assert (pod.drain_dir / "drained").exists()
    assert loop.time() - last_ended < POLL_S + ZERO_CONFIRM_S + EXIT_SLACK_S
    outcomes = [e["outcome"] for e in pod.log_events() if e["event"] == "drain.finished"]
    assert outcomes == ["drained"]


async def test_the_engines_prestop_script_returns_once_drained_and_sigterm_then_exits(pod: Pod) -> None:
    running = asyncio.create_task(stream(pod.engine_port, max_tokens=50))
    await asyncio.sleep(0.1)
    hook = await asyncio.create_subprocess_exec("/bin/sh", str(pod.drain_dir / "prestop"))
    await asyncio.sleep(0.3)
    assert await pod.ready() == 503
    assert hook.returncode is None, "the preStop hook waits while a stream runs"
    assert (await running)[-1] == "[DONE]"
    assert await asyncio.wait_for(hook.wait(), 3) == 0
    assert pod.sidecar.returncode is None, "drained, it waits for its own SIGTERM"
    pod.sidecar.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(pod.sidecar.wait(), 2) == 0


def switches(pid: int) -> int:
    """Times the process's main thread has stopped running: each wait it wakes from, and each preemption."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text().splitlines()
    return sum(int(line.split()[1]) for line in status if line.split(":")[0].endswith("ctxt_switches"))


async def test_an_idle_sidecar_runs_no_timer_and_still_leaves_rotation_at_once_on_the_prestop(pod: Pod) -> None:
    await asyncio.sleep(0.3)  # past the fixture's last /ready and its connection's close
    before = switches(pod.sidecar.pid)
    await asyncio.sleep(1.5)  # 7 polls of the drain directory at its --poll-interval, as it once did
    assert switches(pod.sidecar.pid) == before, "nothing woke the idle sidecar"
    hook = await asyncio.create_subprocess_exec("/bin/sh", str(pod.drain_dir / "prestop"), env={"PATH": ""})
    await until(lambda: (pod.drain_dir / "draining").exists(), timeout_s=5)
    assert await pod.ready() == 503
    assert await asyncio.wait_for(hook.wait(), 5) == 0
    started = [e["reason"] for e in pod.log_events() if e["event"] == "drain.started"]
    assert started == ["prestop"]


@pytest.mark.parametrize("pod", [(("--drain-timeout", "1"), ())], indirect=True)
async def test_the_timeout_cuts_what_is_left_counts_it_and_still_exits_cleanly(pod: Pod) -> None:
    streams = [asyncio.create_task(stream(pod.engine_port, max_tokens=1000)) for _ in range(2)]
    await asyncio.sleep(0.2)
    loop = asyncio.get_running_loop()
    pod.sidecar.send_signal(signal.SIGTERM)
    sent = loop.time()
    assert await asyncio.wait_for(pod.sidecar.wait(), 4) == 0
    assert 1.0 <= loop.time() - sent < 2.0
    timeouts = [e for e in pod.log_events() if e["event"] == "drain.timeout"]
    assert [e["streams_cut"] for e in timeouts] == [2]
    for task in streams:
        task.cancel()


@pytest.mark.parametrize(
    "pod", [(("--stall-after", "0.8", "--drain-timeout", "30"), ("--leak-disconnected",))], indirect=True
)
async def test_a_gauge_left_up_by_clients_that_went_away_ends_as_a_stall_not_a_timeout(pod: Pod) -> None:
    gone = asyncio.create_task(stream(pod.engine_port, max_tokens=1000))
    await asyncio.sleep(0.3)
    gone.cancel()
    await asyncio.sleep(0.2)
    loop = asyncio.get_running_loop()
    pod.sidecar.send_signal(signal.SIGTERM)
    sent = loop.time()
    assert await asyncio.wait_for(pod.sidecar.wait(), 10) == 0
    assert loop.time() - sent < 5
    finished = [e for e in pod.log_events() if e["event"] == "drain.finished"]
    assert [e["outcome"] for e in finished] == ["stalled"]


async def test_a_prestop_under_dash_with_no_path_holds_the_engine_and_lets_go_when_the_sidecar_is_killed(
    pod: Pod,
) -> None:
    dash = shutil.which("dash")
    if dash is None:
        pytest.skip("dash is not installed here (Debian: apt-get install dash)")
    running = asyncio.create_task(stream(pod.engine_port, max_tokens=500))
    await asyncio.sleep(0.1)
    hook = await asyncio.create_subprocess_exec(dash, str(pod.drain_dir / "prestop"), env={"PATH": ""})
    await asyncio.sleep(0.6)
    assert hook.returncode is None, "no sleep command, and still the hook waits while a stream runs"
    loop = asyncio.get_running_loop()
    pod.sidecar.kill()
    await pod.sidecar.wait()
    killed = loop.time()
    assert await asyncio.wait_for(hook.wait(), 2) == 0, "a dead sidecar never holds the engine to the grace period"
    assert loop.time() - killed < 0.5
    assert not (pod.drain_dir / "drained").exists()
    running.cancel()


async def test_a_sidecar_killed_mid_drain_and_started_again_resumes_draining_and_never_serves(tmp_path: Path) -> None:
    notice = {"answer": (204, "")}

    async def notice_endpoint(_: web.Request) -> web.Response:
        status, body = notice["answer"]
        return web.Response(status=status, text=body or None, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/notice", notice_endpoint)
    runner = web.AppRunner(app)
    await runner.setup()
    notice_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", notice_port).start()
    processes: list[asyncio.subprocess.Process] = []
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        kube.add_pod("ml", "vllm-0", node="gpu-1", readiness_gates=["spotdrain.io/serving"])
        account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")

        def gate() -> str | None:
            pod = kube.pod("ml", "vllm-0") or {}
            found = [c for c in pod["status"].get("conditions", []) if c["type"] == "spotdrain.io/serving"]
            return found[0]["status"] if found else None

        engine_port = free_port()
        drain_dir = tmp_path / "drain"
        flags = ["--endpoint-delay", "0.3", "--poll-interval", str(POLL_S), "--drain-timeout", "30"]
        flags += ["--notice-url", f"http://127.0.0.1:{notice_port}/v1/notice", "--readiness-gate"]
        flags += ["--pod-name", "vllm-0", "--serviceaccount-dir", str(account)]

        async def sidecar(name: str) -> tuple[asyncio.subprocess.Process, int]:
            port = free_port()
            args = sidecar_args(port=port, engine_port=engine_port, drain_dir=drain_dir, extra=flags)
            process = await start(args, log_path=tmp_path / f"{name}.log", env=kube.service_env())
            processes.append(process)
            return process, port

        try:
            processes.append(
                await start(engine_args(engine_port, "--tokens-per-second", "50"), log_path=tmp_path / "e")
            )
            first, port = await sidecar("first")
            await wait_http(f"http://127.0.0.1:{port}/ready", status=200)
            await until(lambda: gate() == "True", timeout_s=5)
            running = asyncio.create_task(stream(engine_port, max_tokens=150))  # 3 s
            await asyncio.sleep(0.2)
            notice["answer"] = (200, '{"id":"n","kind":"spot-interruption","deadline":"2099-01-01T00:00:00Z"}')
            await until(lambda: gate() == "False", timeout_s=5)
            first.kill()
            await first.wait()
            # The node agent's endpoint is no help to the new sidecar: it must find the drain in its directory.
            notice["answer"] = (500, "agent restarting")
            _, port = await sidecar("second")
            answers: list[int] = []
            seen_gate: set[str | None] = set()
            async with asyncio.timeout(8):
                while not (drain_dir / "drained").exists():
                    with contextlib.suppress(aiohttp.ClientError):  # until it listens
                        answers.append((await status_of(f"http://127.0.0.1:{port}/ready"))[0])
                    seen_gate.add(gate())
                    await asyncio.sleep(0.02)
            assert (await running)[-1] == "[DONE]", "the stream outlived the restart"
            assert len(answers) > 10
            assert set(answers) == {503}, "the restarted sidecar never answered ready"
            assert seen_gate == {"False"}, "nor set the readiness gate True"
            events = [json.loads(line) for line in (tmp_path / "second.log").read_text().splitlines() if "{" in line]
            resumed = [e for e in events if e["event"] == "drain.resumed"]
            assert [e["reason"] for e in resumed] == ["notice:spot-interruption"]
            assert resumed[0]["deadline"] == "2099-01-01T00:00:00Z"
            assert [e["outcome"] for e in events if e["event"] == "drain.finished"] == ["drained"]
        finally:
            for process in processes:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            await runner.cleanup()
