"""200 sidecar processes at default settings, each against a fake engine page of its own, all waiting on one
notice board: their total CPU while serving (each holding one long poll on the board) and while draining (reading
their engine's metrics every 0.5 s with in-flight above zero), their total memory, and how long a published notice
takes to put every one of them out of rotation.

Targets, for 200 sidecars (about 25 eight-GPU nodes' worth):
- serving under 0.05 cores in all: an idle sidecar waits on its held request and costs next to nothing;
- notice published to each sidecar out of rotation (its ``drain.started``, when ``/ready`` turns 503): p99 under
  50 ms, where polling took up to its 0.5 s interval;
- draining under 0.5 cores: 2.5 millicores a sidecar, a quarter of its CPU request in the manifests (10m), so that
  a drain never waits on a busy node's CPU;
- a look at the engine's connections under 25 ms of CPU. The kernel walks its whole TCP table for it, so the sidecar
  counts only while a drain sees no progress (in-flight and tokens still, for at most ``--stall-after``): at one
  count per 0.5 s poll that is at most 5 % of a core for those seconds;
- resident memory under 200 times the sidecar's memory request in the manifests (48Mi), since each pod has its own;
  the proportional share (PSS), which counts the interpreter's shared pages once, is reported beside it.

The engine side is one process answering every engine port from prebuilt pages, and the notice endpoint is the
agent's own board (both in ``bench.fleet_peers``). Only the sidecars' CPU is counted. Nothing here asks the sidecars
anything while they react to a notice, which would take the CPU they react on: their logs are read, and each
``/ready`` is checked, only after. All processes share one network namespace, unlike pods: the sockets every
draining sidecar reads through in ``/proc/net/tcp`` are those of all 200, and their number is reported with the
draining result. The agent's own cost of 1,000 held requests is measured in ``bench.waiting``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import Result, cpu_s, report, rss_mb
from bench.fleet_peers import DRAINING_IN_FLIGHT
from simulate.fakes.processes import free_port, sidecar_args, start, wait_http
from spotdrain.clock import parse_rfc3339

SIDECARS = 200
BATCH = 25  # sidecars started at once: their imports take the machine for a while
WINDOW_S = 10.0
ENDPOINT_DELAY_S = 5.0  # the sidecar's default: it reads nothing from its engine until then
CPU_TARGET_CORES = 0.5
IDLE_CPU_TARGET_CORES = 0.05
PUSH_TARGET_S = 0.05
REACT_S = 1.0  # the sidecars' logs are first read this long after the publish (they all react well within it)
RSS_TARGET_MB = 48 * 1.048576 * SIDECARS  # the sidecar's memory request in the manifests, 48Mi
# Taken once per 0.5 s poll only while nothing moves: 25 ms is 5 % of a core for at most --stall-after seconds.
COUNT_TARGET_MS = 25.0


def pss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return 0.0


def connection_count_ms(calls: int = 50) -> float:
    """CPU milliseconds one look at an engine's connections costs on this machine, as the sidecar looks: sock_diag
    (the kernel filters the port), or both /proc/net/tcp tables where sock_diag cannot be asked."""
    from sidecar.connections import EngineConnections

    look = EngineConnections()
    began = time.process_time()
    for _ in range(calls):
        look(1)
    return (time.process_time() - began) / calls * 1000


def ehash_entries() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_ehash_entries").read_text().strip()
    except OSError:
        return "unknown"


def tcp_rows() -> int:
    """Sockets in this network namespace, which a draining sidecar reads through on every reading."""
    return sum(len(Path(p).read_text().splitlines()) - 1 for p in ("/proc/net/tcp", "/proc/net/tcp6"))


Started = list[tuple[int, asyncio.subprocess.Process]]  # (sidecar port, process)


def _ports(count: int, *, taken: set[int]) -> list[int]:
    """``count`` free ports, none of them ``taken`` nor twice the same (the kernel may hand out a port again)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in taken:
            taken.add(port)
            ports.append(port)
    return ports


async def _start_sidecars(
    workdir: Path, engine_ports: Sequence[int], notice_url: str, procs: list[asyncio.subprocess.Process]
) -> Started:
    """Start one sidecar per engine port, a batch at a time; returns once every one is ready. Each process is in
    ``procs`` from its start, so that one that never gets ready leaves none of them running."""
    started: Started = []
    sidecar_ports = _ports(len(engine_ports), taken=set(engine_ports))
    for first in range(0, len(engine_ports), BATCH):
        batch: Started = []
        for index, engine_port in enumerate(engine_ports[first : first + BATCH], start=first):
            port = sidecar_ports[index]
            drain_dir = workdir / f"drain-{index}"
            args = sidecar_args(
                port=port, engine_port=engine_port, drain_dir=drain_dir, extra=["--notice-url", notice_url]
            )
            batch.append((port, await start(args, log_path=workdir / f"sidecar-{index}.log")))
            procs.append(batch[-1][1])
        await asyncio.gather(*(wait_http(f"http://127.0.0.1:{p}/ready", status=200, timeout_s=60) for p, _ in batch))
        started += batch
    return started


async def _cores(pids: Sequence[int], window_s: float) -> float:
    """CPU the processes used over the window, in cores."""
    before, t0 = sum(cpu_s(pid) for pid in pids), time.monotonic()
    await asyncio.sleep(window_s)
    return (sum(cpu_s(pid) for pid in pids) - before) / (time.monotonic() - t0)


async def _drains_started(logs: Sequence[Path]) -> list[float]:
    """When each sidecar logged ``drain.started``, once every one has; the logs are first read ``REACT_S`` after the
    publish, then every 0.1 s, so that this process takes none of the CPU the sidecars react on."""
    await asyncio.sleep(REACT_S)
    give_up = time.monotonic() + 30
    while None in (found := [drain_started_at(log) for log in logs]):
        if time.monotonic() > give_up:
            raise RuntimeError(f"{found.count(None)} sidecars never logged drain.started")
        await asyncio.sleep(0.1)
    return [at for at in found if at is not None]


async def _check_out_of_rotation(ports: Sequence[int]) -> None:
    """Every sidecar's ``/ready`` answers 503 (it did from its ``drain.started`` on); raises if one does not."""
    async with aiohttp.ClientSession() as session:
        for port in ports:
            async with session.get(f"http://127.0.0.1:{port}/ready") as response:
                if response.status != 503:
                    raise RuntimeError(f"sidecar on {port} logged drain.started but /ready answers {response.status}")


async def _spawn(procs: list[asyncio.subprocess.Process], *args: str) -> dict[str, Any]:
    """Start ``python -m bench.fleet_peers ARGS`` and read the JSON line it prints first."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.fleet_peers", *args, stdout=asyncio.subprocess.PIPE
    )
    procs.append(process)
    assert process.stdout is not None
    bound: dict[str, Any] = json.loads(await asyncio.wait_for(process.stdout.readline(), 20))
    return bound


def drain_started_at(log: Path) -> float | None:
    """When a sidecar logged ``drain.started`` (its ``/ready`` answers 503 from then on), in epoch seconds; None
    while it has not."""
    for line in log.read_text().splitlines():
        if '"drain.started"' in line:
            return parse_rfc3339(json.loads(line)["timestamp"]).timestamp()
    return None


def _push_results(delays: Sequence[float], cpu_each_s: float) -> list[Result]:
    ranked = sorted(delays)
    p50, p99 = statistics.median(ranked), ranked[int(len(ranked) * 0.99) - 1]
    detail = (
        f"notice published on the agent's board to each of {len(ranked)} sidecars' drain.started (/ready 503), "
        f"each holding one long poll; p50 {p50 * 1000:.1f} ms, max {ranked[-1] * 1000:.1f} ms on {os.cpu_count()} "
        f"cores; each sidecar used {cpu_each_s * 1000:.1f} ms of CPU in the {REACT_S:g} s after the publish (its "
        "whole reaction: the flip, its log lines, its drain record); each /ready checked 503 after that"
    )
    return [Result.below("fleet_notice_to_out_of_rotation_p99", p99, "s", PUSH_TARGET_S, detail)]


async def _run(workdir: Path, procs: list[asyncio.subprocess.Process]) -> list[Result]:
    engine_ports = (await _spawn(procs, "pages", str(SIDECARS)))["engines"]
    board = f"http://127.0.0.1:{(await _spawn(procs, 'board'))['notice']}"
    await wait_http(f"{board}/v1/notice", status=204, timeout_s=20)
    sidecars = await _start_sidecars(workdir, engine_ports, f"{board}/v1/notice", procs)
    pids = [process.pid for _, process in sidecars]
    await asyncio.sleep(2.0)  # let start-up work settle
    serving = await _cores(pids, WINDOW_S)
    async with aiohttp.ClientSession() as session:
        await session.post(f"http://127.0.0.1:{engine_ports[0]}/_drain")  # every engine page now reads in-flight 3
        before = sum(cpu_s(pid) for pid in pids)
        async with session.post(f"{board}/_publish") as response:
            published = (await response.json())["published"]
    started = await _drains_started([workdir / f"sidecar-{index}.log" for index in range(len(sidecars))])
    cpu_each_s = (sum(cpu_s(pid) for pid in pids) - before) / len(pids)
    await _check_out_of_rotation([port for port, _ in sidecars])
    delays = [at - published for at in started]
    await asyncio.sleep(ENDPOINT_DELAY_S + 1.0)
    draining = await _cores(pids, WINDOW_S)
    rows = tcp_rows()
    rss, pss = sum(rss_mb(pid) for pid in pids), sum(pss_mb(pid) for pid in pids)
    per = f"{SIDECARS} sidecars at default settings over {WINDOW_S:g} s on {os.cpu_count()} cores"
    drain_detail = f"{per}, each reading in-flight {DRAINING_IN_FLIGHT} every 0.5 s; {rows} sockets in /proc/net/tcp*"
    count_detail = (
        "one look at the engine's connections (sock_diag filtered in the kernel to the port, else /proc/net/tcp and "
        "tcp6), taken only once a zero is confirmed or a drain sees no progress; the kernel walks its whole TCP hash "
        f"table ({ehash_entries()} entries here) for it, whatever the sockets"
    )
    serving_detail = f"{per}, each holding one long poll (--notice-wait 30) on the agent's notice board"
    return [
        Result.below("fleet_cpu_serving", serving, "cores", IDLE_CPU_TARGET_CORES, serving_detail),
        *_push_results(delays, cpu_each_s),
        Result.below("fleet_cpu_draining", draining, "cores", CPU_TARGET_CORES, drain_detail),
        Result.below("fleet_rss_total", rss, "MB", RSS_TARGET_MB, f"{per}; proportional share (PSS) {pss:.0f} MB"),
        Result.below("sidecar_connection_count_cpu", connection_count_ms(), "ms", COUNT_TARGET_MS, count_detail),
    ]


async def measure() -> list[Result]:
    procs: list[asyncio.subprocess.Process] = []
    with tempfile.TemporaryDirectory(prefix="spotdrain-fleet-") as workdir:
        try:
            return await _run(Path(workdir), procs)
        finally:
            for process in procs:
                if process.returncode is None:
                    process.kill()
            await asyncio.gather(*(process.wait() for process in procs))


if __name__ == "__main__":
    report(asyncio.run(measure()))
