"""The node agent as a real process (IMDS mode, against the fake IMDS and the fake API server) holding 1,000 long
polls on its notice endpoint: its CPU and resident memory while they wait, beside the same agent idle, and how long
a Spot notice appearing in IMDS takes to answer all of them.

In queue mode one agent serves every node's sidecars: 1,000 held requests is some 125 eight-GPU nodes' worth.
Targets: the agent's idle targets (the DaemonSet's 128 MB memory limit, 0.01 cores), since a held request should
cost next to nothing; and every request answered within the 1.5 s the agent has from notice to taint (its 1 s IMDS
interval included).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import aiohttp

from bench.common import Result, cpu_s, rss_mb
from bench.node import IDLE_CPU_TARGET, LATENCY_TARGET_S, MEMORY_TARGET_MB, agent_args
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import start, wait_http
from spotdrain.clock import utcnow

WAITING = 1000
WINDOW_S = 10.0


async def _cores(pid: int, window_s: float) -> float:
    before, began = cpu_s(pid), time.monotonic()
    await asyncio.sleep(window_s)
    return (cpu_s(pid) - before) / (time.monotonic() - began)


async def _get(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=90)) as response:
        await response.read()
        return response.status


async def _measure(workdir: Path) -> list[Result]:
    imds = FakeImds()
    async with FakeKube() as kube, serving(imds) as imds_url:
        kube.add_node("gpu-0")
        args = agent_args(node="gpu-0", imds_url=imds_url, kubeconfig=kube.write_kubeconfig(workdir / "kubeconfig"))
        url = f"http://127.0.0.1:{args[args.index('--notice-port') + 1]}/v1/notice"
        agent = await start(args, log_path=workdir / "agent.log")
        try:
            await wait_http(url, status=204, timeout_s=30)
            await asyncio.sleep(2.0)
            idle_cpu, idle_rss = await _cores(agent.pid, WINDOW_S), rss_mb(agent.pid)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
                requests = [asyncio.create_task(_get(session, f"{url}?wait=60")) for _ in range(WAITING)]
                await asyncio.sleep(3.0)  # every request sent and held
                cpu, rss = await _cores(agent.pid, WINDOW_S), rss_mb(agent.pid)
                held = sum(not request.done() for request in requests)
                imds.schedule_spot("terminate", utcnow().replace(microsecond=0) + timedelta(seconds=120))
                shown = time.monotonic()
                statuses = await asyncio.gather(*requests)
                released = time.monotonic() - shown
        finally:
            agent.terminate()
            await agent.wait()
    answered = sum(status == 200 for status in statuses)
    detail = f"{WAITING} requests GET /v1/notice?wait=60 held ({held} still held after the window); idle agent"
    return [
        Result.below("agent_waiting_rss", rss, "MB", MEMORY_TARGET_MB, f"{detail} {idle_rss:.1f} MB"),
        Result.below("agent_waiting_cpu", cpu, "cores", IDLE_CPU_TARGET, f"{detail} {idle_cpu:.4f} cores"),
        Result(
            "agent_waiting_released",
            round(released, 4),
            "s",
            LATENCY_TARGET_S,
            held == answered == WAITING and released < LATENCY_TARGET_S,  # every one held, then answered 200
            f"Spot notice shown in IMDS (1 s interval) to all {WAITING} held requests answered; {answered} with 200",
        ),
    ]


async def measure() -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-waiting-") as workdir:
        return await _measure(Path(workdir))


if __name__ == "__main__":
    from bench.common import report

    report(asyncio.run(measure()))
