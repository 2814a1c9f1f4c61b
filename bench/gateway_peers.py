"""The gateway beside the Rust routers, in one run: what each adds to every chunk, what it costs, and whether the
bytes that reach the client are the engine's.

One backend (bench/sse_source.py) serves every target: ``direct`` (the backend itself), the gateway at its default
``--workers`` (the targets are read on it) and with one worker (``SPOTDRAIN_BENCH_GATEWAY_ARGS`` adds flags to both),
and each peer bench/peer_routers.py could install. Three loads, each in rounds that interleave the targets (the order
turns each round, so no target always runs on a machine its predecessor just warmed or loaded): 1 stream, 100
streams at 50 chunks/s each, 500 at 20/s, started over one chunk interval. Clients run in processes of their own
(bench/relay_client.py) and check every event byte for byte. A figure is the median over rounds; "added" is a
target's percentile less the direct one of the same round. This is a shared 2-core machine: the load average at each
round's start is in the details.

Targets (on 2 cores): at 100 streams, CPU per chunk at most 1.5 times the better router's and p99 added at most
twice theirs; at 500 streams p50 added at most 5 ms; at 1 stream p90 added at most 0.5 ms; resident memory at most
60 MB idle per process and 20 KB per open stream; every stream exact, with one ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import Result, cpu_s, rss_mb
from bench.gateway import percentile
from bench.peer_routers import LITELLM_SKIPPED, Missing, Peer, argv_for, routers
from gateway.cpus import default_workers
from simulate.fakes.processes import free_port, wait_http

CPU_RATIO_TARGET = 1.5
P99_RATIO_TARGET = 2.0
P50_ADDED_500_TARGET_MS = 5.0
P90_ADDED_1_TARGET_MS = 0.5
IDLE_RSS_TARGET_MB = 60.0
PER_STREAM_TARGET_KB = 20.0
ROUNDS = int(os.environ.get("SPOTDRAIN_BENCH_ROUNDS", "3"))
SPOTDRAIN = f"spotdrain ({default_workers()} workers)"
SPOTDRAIN_ONE = "spotdrain (1 worker)"
DIRECT = "direct"


@dataclass(frozen=True)
class Load:
    name: str
    streams: int
    chunks: int
    interval_s: float
    clients: int  # load-generator processes


LOADS = (
    Load("1 stream", 1, 200, 0.005, 1),
    Load("100 streams", 100, 100, 0.02, 2),
    Load("500 streams", 500, 40, 0.05, 2),
)


@dataclass
class Run:
    """One target under one load in one round."""

    latencies_ms: list[float]
    streams: int
    exact: int
    faults: list[str]
    cpu_s: float | None  # the target's processes, over the run (None: direct)
    load_average: float

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    @property
    def cpu_per_chunk_us(self) -> float | None:
        return None if self.cpu_s is None else self.cpu_s / max(1, len(self.latencies_ms)) * 1e6


@dataclass
class Target:
    name: str
    url: str
    pid: int | None  # its root process (None: direct)
    idle_mb: float | None = None
    peak_mb: float = 0.0
    per_process_idle_mb: float | None = None
    runs: dict[str, list[Run]] = field(default_factory=dict)


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    found = [pid]
    for child in _children(pid):
        found += tree(child)
    return found


def _children(pid: int) -> list[int]:
    children: list[int] = []
    with suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(x) for x in (task / "children").read_text().split()]
    return children


def tree_cpu_s(pid: int) -> float:
    total = 0.0
    for each in tree(pid):
        with suppress(OSError, RuntimeError):
            total += cpu_s(each)
    return total


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory of the whole tree, and of its largest process."""
    sizes = []
    for each in tree(pid):
        with suppress(OSError, RuntimeError, StopIteration):
            sizes.append(rss_mb(each))
    return sum(sizes), max(sizes, default=0.0)


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


def ours(*, workers: int | None = None) -> Peer:
    """The gateway as a target: at its default ``--workers``, or at ``workers``."""
    extra = shlex.split(os.environ.get("SPOTDRAIN_BENCH_GATEWAY_ARGS", ""))
    argv = [
        *(sys.executable, "-m", "spotdrain.cli", "--log-format", "json", "--log-level", "warning", "gateway"),
        *("--host", "127.0.0.1", "--port", "{port}", "--metrics-port", "{metrics_port}", "--backend", "{backend}"),
        *extra,
    ]
    if workers is None:
        return Peer(SPOTDRAIN, argv)
    return Peer(SPOTDRAIN_ONE, [*argv, "--workers", str(workers)])


async def client_run(url: str, load: Load) -> tuple[list[float], int, int, list[str]]:
    """``load``'s streams to ``url`` from its client processes: latencies, streams, exact streams, faults."""
    body = {"model": "bench", "prompt": "x", "max_tokens": load.chunks}
    shares = [load.streams // load.clients + (c < load.streams % load.clients) for c in range(load.clients)]
    children = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.relay_client",
            json.dumps({"url": url, "count": share, "body": body, "spread_s": load.interval_s}),
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
    before = tree_cpu_s(target.pid) if target.pid else 0.0
    sampling = asyncio.create_task(_peak(target)) if target.pid else None
    load_average = os.getloadavg()[0]
    try:
        latencies, streams, exact, faults = await client_run(target.url, load)
    finally:
        if sampling is not None:
            sampling.cancel()
    used = tree_cpu_s(target.pid) - before if target.pid else None
    return Run(latencies, streams, exact, faults, used, load_average)


async def _peak(target: Target) -> None:
    assert target.pid is not None
    while True:
        target.peak_mb = max(target.peak_mb, tree_rss_mb(target.pid)[0])
        await asyncio.sleep(0.1)


async def play(workdir: Path, load: Load, peers: list[Peer]) -> list[Target]:
    """The backend at ``load``'s pace, every target in front of it, ``ROUNDS`` interleaved rounds."""
    backend_port = free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    source = [sys.executable, "-m", "bench.sse_source", "--port", str(backend_port), "--interval", str(load.interval_s)]
    async with started(source, workdir / "backend.log", f"{backend}/health"):
        targets = [Target(DIRECT, f"{backend}/v1/completions", None)]
        await _with(workdir, load, [ours(), ours(workers=1), *peers], backend, targets)
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


def _median(values: list[float]) -> float:
    return statistics.median(values)


def absolute(target: Target, load: str, q: float) -> float:
    return _median([run.p(q) for run in target.runs[load]])


def added(target: Target, direct: Target, load: str, q: float) -> float:
    """The median over rounds of what ``target`` added to the direct percentile of the same round."""
    pairs = zip(target.runs[load], direct.runs[load], strict=True)
    return _median([run.p(q) - alone.p(q) for run, alone in pairs])


def cpu_per_chunk_us(target: Target, load: str) -> float | None:
    values = [run.cpu_per_chunk_us for run in target.runs[load]]
    return None if None in values else _median([v for v in values if v is not None])


def rounds_detail(direct: Target) -> str:
    loads = {name: [round(run.load_average, 2) for run in runs] for name, runs in direct.runs.items()}
    return f"{ROUNDS} rounds; load average (1 min) at each round's start: {json.dumps(loads)}"


def table(targets: list[Target]) -> str:
    """The comparison as a Markdown table (latencies absolute, ms; CPU µs per chunk; RSS MB)."""
    head = (
        "| proxy | 1 stream: p50 / p90 | 100 streams: p50 / p99 | 500 streams: p50 / p99 "
        "| CPU per chunk at 100 streams | RSS idle / peak |\n| --- | --- | --- | --- | --- | --- |"
    )
    rows = [head]
    for t in targets:
        one = f"{absolute(t, LOADS[0].name, 0.5):.2f} / {absolute(t, LOADS[0].name, 0.9):.2f} ms"
        hundred = f"{absolute(t, LOADS[1].name, 0.5):.2f} / {absolute(t, LOADS[1].name, 0.99):.1f} ms"
        five = f"{absolute(t, LOADS[2].name, 0.5):.2f} / {absolute(t, LOADS[2].name, 0.99):.1f} ms"
        cpu = cpu_per_chunk_us(t, LOADS[1].name)
        cpu_text = "—" if cpu is None else f"{cpu:.1f} µs"
        rss = "—" if t.idle_mb is None else f"{t.idle_mb:.0f} / {t.peak_mb:.0f} MB"
        rows.append(f"| {t.name} | {one} | {hundred} | {five} | {cpu_text} | {rss} |")
    return "\n".join(rows)


def merged(by_load: dict[str, list[Target]]) -> list[Target]:
    """One target per name with every load's runs; memory as measured at the largest load."""
    largest = by_load[LOADS[-1].name]
    for targets in by_load.values():
        for target, big in zip(targets, largest, strict=True):
            big.runs.update(target.runs)
    return largest


def results(targets: list[Target], missing: list[Missing]) -> list[Result]:
    direct, ours = targets[0], next(t for t in targets if t.name == SPOTDRAIN)
    peers = [t for t in targets if t.name not in (DIRECT, SPOTDRAIN, SPOTDRAIN_ONE)]
    rounds = rounds_detail(direct)
    out = [_exact(targets, rounds)]
    one, five = LOADS[0].name, LOADS[2].name
    p90 = added(ours, direct, one, 0.9)
    out.append(_at_most("gateway_peers_p90_added_1_stream", p90, "ms", P90_ADDED_1_TARGET_MS, rounds))
    p50 = added(ours, direct, five, 0.5)
    out.append(_at_most("gateway_peers_p50_added_500_streams", p50, "ms", P50_ADDED_500_TARGET_MS, rounds))
    out += _ratios(ours, direct, peers, missing, rounds)
    assert ours.idle_mb is not None
    assert ours.per_process_idle_mb is not None
    per_stream = (ours.peak_mb - ours.idle_mb) * 1024 / LOADS[-1].streams
    detail = f"largest process {ours.per_process_idle_mb:.1f} MB of {ours.idle_mb:.1f} MB in all, after start"
    idle = ours.per_process_idle_mb
    out.append(_at_most("gateway_peers_rss_idle_per_process", idle, "MB", IDLE_RSS_TARGET_MB, detail))
    detail = f"peak {ours.peak_mb:.1f} MB over {LOADS[-1].streams} streams, {ours.idle_mb:.1f} MB idle (all processes)"
    out.append(_at_most("gateway_peers_rss_per_open_stream", per_stream, "KB", PER_STREAM_TARGET_KB, detail))
    return out


def _at_most(name: str, value: float, unit: str, target: float, detail: str) -> Result:
    return Result(name, round(value, 4), unit, target, value <= target, detail)


def _exact(targets: list[Target], rounds: str) -> Result:
    """Streams that were not exactly the engine's bytes with one [DONE], over every target and load."""
    bad = 0
    parts = []
    for t in targets:
        runs = [run for runs in t.runs.values() for run in runs]
        streams, exact = sum(r.streams for r in runs), sum(r.exact for r in runs)
        bad += streams - exact
        faults = [f for r in runs for f in r.faults][:2]
        parts.append(f"{t.name}: {exact} of {streams}" + (f" (e.g. {faults})" if faults else ""))
    return Result("gateway_peers_streams_not_exact", bad, "streams", 0, bad == 0, "; ".join(parts) + f"; {rounds}")


def _ratios(ours: Target, direct: Target, peers: list[Target], missing: list[Missing], rounds: str) -> list[Result]:
    load = LOADS[1].name
    names = ("gateway_peers_cpu_per_chunk_ratio_100_streams", "gateway_peers_p99_ratio_100_streams")
    if not peers:
        why = "; ".join(f"{m.name}: {m.reason}" for m in missing) or "no peer router"
        return [Result.skip(names[0], "x", CPU_RATIO_TARGET, why), Result.skip(names[1], "x", P99_RATIO_TARGET, why)]
    cpu = {t.name: cpu_per_chunk_us(t, load) or 0.0 for t in (ours, *peers)}
    best_cpu = min(peers, key=lambda t: cpu[t.name])
    p99 = {t.name: absolute(t, load, 0.99) for t in (ours, *peers)}
    p99_added = {t.name: added(t, direct, load, 0.99) for t in (ours, *peers)}
    best_p99 = min(peers, key=lambda t: p99[t.name])
    cpu_detail = ", ".join(f"{name} {value:.1f} µs" for name, value in cpu.items())
    p99_detail = ", ".join(f"{name} {p99[name]:.2f} ms ({p99_added[name]:+.2f})" for name in p99)
    return [
        _at_most(
            names[0],
            cpu[ours.name] / cpu[best_cpu.name],
            "x",
            CPU_RATIO_TARGET,
            f"against {best_cpu.name}; CPU per chunk: {cpu_detail}; {rounds}",
        ),
        # The routers' p99 added is within the rounds' noise of the direct one (as often below it as above), so a
        # ratio of added figures would divide by noise: the ratio is of the p99 each delivers, direct included.
        _at_most(
            names[1],
            p99[ours.name] / p99[best_p99.name],
            "x",
            P99_RATIO_TARGET,
            f"against {best_p99.name}; p99 delivered (added to direct's {absolute(direct, load, 0.99):.2f} ms): "
            f"{p99_detail}; {rounds}",
        ),
    ]


async def measure() -> list[Result]:
    found = routers()
    peers = [p for p in found if isinstance(p, Peer)]
    missing = [m for m in found if isinstance(m, Missing)] + [Missing("LiteLLM", LITELLM_SKIPPED)]
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-peers-") as name:
        by_load = {load.name: await play(Path(name), load, peers) for load in LOADS}
    targets = merged(by_load)
    print(table(targets), file=sys.stderr)
    for m in missing:
        print(f"{m.name}: skipped, {m.reason}", file=sys.stderr)
    return [*results(targets, missing), *(Result.skip(f"gateway_peers_{m.name}", "x", 0, m.reason) for m in missing)]
