"""The gateway beside the Rust routers, in one run: what each adds to every chunk, what it costs, and whether the
bytes that reach the client are the engine's.

One backend (bench/sse_source.py) serves every target: ``direct`` (the backend itself), the gateway at its default
``--workers`` (the targets are read on it) and with one worker (``SPOTDRAIN_BENCH_GATEWAY_ARGS`` adds flags to both),
and each peer bench/peer_routers.py could install. Three loads, each in rounds that interleave the targets (the order
turns each round, so no target always runs on a machine its predecessor just warmed or loaded): 1 stream, 100
streams at 50 chunks/s each, 500 at 20/s, started over one chunk interval; then the 100 and 500 again with the
backend dropping one stream in ten halfway (``--break-every``) of those that ask for token ids, the gateway's own,
which it continues on the backend: no router continues a stream, and none asks for ids, so the routers' streams (and
the direct ones) in those rounds are whole, measured beside the gateway's under the same load. Clients run in
processes of their own (bench/relay_client.py) and check every event byte for byte, a continued stream's too. A
figure is the median over rounds; "added" is a target's percentile less the direct one of the same round. Each
target's CPU is also told into the system time of its processes (the kernel's work for its calls) and the rest (its
own code). This is a shared 2-core machine: the load average at each round's start is in the details.

Targets (on 2 cores): CPU per chunk at 100 and at 500 streams at most the better router's, with streams continued
or not; at 500 streams, with streams continued or not, p50 and p99 added at most the better router's, and p50 added
at most 5 ms; at 100 streams p99 at most twice the better router's; at 1 stream p90 added at most 0.5 ms; resident
memory at most 60 MB idle per process and 20 KB per open stream; every stream exact, with one ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from bench.common import CpuMark, Result, tree_rss_mb
from bench.compiled import Unbuilt, built
from bench.peer_figures import CONTINUED, DIRECT, LOADS, Load, Run, Target, merged, results, table
from bench.peer_routers import LITELLM_SKIPPED, Missing, Peer, argv_for, routers
from gateway.cpus import default_workers
from simulate.fakes.processes import free_port, wait_http

ROUNDS = int(os.environ.get("SPOTDRAIN_BENCH_ROUNDS", "3"))
SPOTDRAIN = f"spotdrain ({default_workers()} workers)"
SPOTDRAIN_ONE = "spotdrain (1 worker)"
SPOTDRAIN_SOURCE = f"spotdrain from source ({default_workers()} workers)"
FLOOR = f"Python floor ({default_workers()} workers)"
FLOOR_ONE = "Python floor (1 worker)"


async def _spawn(argv: Sequence[str], log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            *argv, stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL, start_new_session=True
        )


@asynccontextmanager
async def started(argv: Sequence[str], log: Path, health: str) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await _spawn(argv, log)
    try:
        await wait_http(health, status=200, timeout_s=60)
        yield process
    finally:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


def ours(*, workers: int | None = None, compiled: Path | None = None, name: str | None = None) -> Peer:
    """The gateway as a target, at its default ``--workers`` or at ``workers``: its relay path compiled, as its image
    ships it, from ``compiled`` (bench/compiled.py), or run from the source."""
    extra = shlex.split(os.environ.get("SPOTDRAIN_BENCH_GATEWAY_ARGS", ""))
    # Where compiled: that directory first on the path, and the working directory not on it, in the workers too.
    python = [sys.executable]
    if compiled is not None:
        python = ["env", f"PYTHONPATH={compiled}", "PYTHONSAFEPATH=1", sys.executable]
    argv = [
        *(*python, "-m", "spotdrain.cli", "--log-format", "json", "--log-level", "warning", "gateway"),
        *("--host", "127.0.0.1", "--port", "{port}", "--metrics-port", "{metrics_port}", "--backend", "{backend}"),
        *extra,
    ]
    if workers is None:
        return Peer(name or SPOTDRAIN, argv)
    return Peer(name or SPOTDRAIN_ONE, [*argv, "--workers", str(workers)])


def floor(*, workers: int | None = None) -> Peer:
    """bench/python_relay.py: the least a Python proxy does per chunk, at the gateway's default worker count or at
    ``workers``."""
    argv = [sys.executable, "-m", "bench.python_relay", "--port", "{port}", "--backend", "{backend}"]
    if workers is None:
        return Peer(FLOOR, [*argv, "--workers", str(default_workers())])
    return Peer(FLOOR_ONE, [*argv, "--workers", str(workers)])


async def client_run(url: str, load: Load, *, spread_s: float | None = None) -> tuple[list[float], int, int, list[str]]:
    """``load``'s streams to ``url`` from its client processes, started over ``spread_s`` (one chunk interval
    unless given): latencies, streams, exact streams, faults."""
    body = {"model": "bench", "prompt": "x", "max_tokens": load.chunks}
    shares = [load.streams // load.clients + (c < load.streams % load.clients) for c in range(load.clients)]
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.relay_client",
            json.dumps({"url": url, "count": share, "body": body, "spread_s": spread_s or load.interval_s}),
            stdout=asyncio.subprocess.PIPE,
        )
        for share in shares
        if share
    ]
    latencies: list[float] = []
    streams = exact = 0
    faults: list[str] = []
    for child in children:
        out, _ = await child.communicate()
        if child.returncode != 0:
            raise RuntimeError(f"a benchmark client failed with {child.returncode}")
        got = json.loads(out)
        latencies += got["latencies_ms"]
        streams, exact, faults = streams + got["streams"], exact + got["exact"], faults + got["faults"]
    return latencies, streams, exact, faults


async def measured(target: Target, load: Load) -> Run:
    """One run of ``load`` against ``target``, its CPU and peak memory followed meanwhile."""
    pid = target.pid
    before = CpuMark.of(pid) if pid else None
    sampling = asyncio.create_task(_peak(target)) if pid else None
    load_average = os.getloadavg()[0]
    try:
        latencies, streams, exact, faults = await client_run(target.url, load)
    finally:
        if sampling is not None:
            sampling.cancel()
    if not pid or before is None:
        return Run(latencies, streams, exact, faults, None, load_average)
    used, kernel = CpuMark.of(pid).since(before)
    return Run(latencies, streams, exact, faults, used, load_average, kernel_s=kernel)


async def _peak(target: Target) -> None:
    assert target.pid is not None
    while True:
        target.peak_mb = max(target.peak_mb, tree_rss_mb(target.pid)[0])
        await asyncio.sleep(0.1)


async def play(workdir: Path, load: Load, peers: list[Peer], compiled: Path | None) -> list[Target]:
    """The backend at ``load``'s pace, every target in front of it (the floor left out where the load breaks
    streams), ``ROUNDS`` interleaved rounds. The gateway is ``compiled``'s where it was built (and from the source
    beside it), else from the source."""
    backend_port = free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    source = [sys.executable, "-m", "bench.sse_source", "--port", str(backend_port), "--interval", str(load.interval_s)]
    source += ["--break-every", str(load.break_every)]
    others = peers if load.break_every else [floor(), floor(workers=1), *peers]
    async with started(source, workdir / "backend.log", f"{backend}/health"):
        targets = [Target(DIRECT, f"{backend}/v1/completions", None)]
        gateways = [ours(compiled=compiled), ours(workers=1, compiled=compiled)]
        gateways += [ours(name=SPOTDRAIN_SOURCE)] if compiled is not None else []
        await _with(workdir, load, [*gateways, *others], backend, targets)
    return targets


async def _with(workdir: Path, load: Load, proxies: list[Peer], backend: str, targets: list[Target]) -> None:
    """Start each of ``proxies`` in front of ``backend``, then play the rounds with every one running."""
    if proxies:
        proxy, rest = proxies[0], proxies[1:]
        port = free_port()
        argv = argv_for(proxy, port=port, metrics_port=free_port(), backend=backend)
        log = workdir / f"{proxy.name.split()[0]}-{len(rest)}.log"
        async with started(argv, log, f"http://127.0.0.1:{port}/health") as process:
            targets.append(Target(proxy.name, f"http://127.0.0.1:{port}/v1/completions", process.pid))
            await _with(workdir, load, rest, backend, targets)
        return
    await asyncio.sleep(1.0)  # health checks settled
    for target in targets:
        if target.pid:
            target.idle_mb, target.per_process_idle_mb = tree_rss_mb(target.pid)
        target.peak_mb = 0.0
    warm = Load(load.name, min(load.streams, 50), 5, load.interval_s, 1)
    for target in targets:
        await client_run(target.url, warm)
    for round_ in range(ROUNDS):
        turn = round_ % len(targets)
        for target in targets[turn:] + targets[:turn]:
            target.runs.setdefault(load.name, []).append(await measured(target, load))


async def measure() -> list[Result]:
    found = routers()
    peers = [p for p in found if isinstance(p, Peer)]
    missing = [m for m in found if isinstance(m, Missing)] + [Missing("LiteLLM", LITELLM_SKIPPED)]
    compiled = built()
    gateway = None if isinstance(compiled, Unbuilt) else compiled
    build = f"from the source: {compiled.reason}" if isinstance(compiled, Unbuilt) else "compiled as its image has it"
    if gateway is None:
        print(f"the gateway runs {build}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-peers-") as name:
        by_load = {load.name: await play(Path(name), load, peers, gateway) for load in (*LOADS, *CONTINUED)}
    targets = merged(by_load)
    print(table(targets), file=sys.stderr)
    for m in missing:
        print(f"{m.name}: skipped, {m.reason}", file=sys.stderr)
    peer_names = [p.name for p in peers]
    figures = results(targets, missing, ours=SPOTDRAIN, peers=peer_names, floor=FLOOR, rounds=ROUNDS, build=build)
    return [*figures, *(Result.skip(f"gateway_peers_{m.name}", "x", 0, m.reason) for m in missing)]
