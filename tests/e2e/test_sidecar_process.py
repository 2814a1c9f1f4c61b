"""The real ``spotdrain sidecar`` process beside the fake engine process, driven by real signals."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.fakes.processes import engine_args, free_port, sidecar_args, start, status_of, stream, wait_http

pytestmark = pytest.mark.e2e

POLL_S = 0.2
# A reading lands within one poll interval of a stream's end; the zero is confirmed a tenth of one later, and a
# Python process needs a few tens of milliseconds to exit.
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
            extra=["--endpoint-delay", "0.3", "--poll-interval", str(POLL_S), *flags],
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
    assert loop.time() - last_ended < POLL_S + EXIT_SLACK_S
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
