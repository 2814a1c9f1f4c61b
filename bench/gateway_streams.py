"""What a stream's start and end cost a proxy, apart from its chunks: the gateway beside the Rust routers, in one run.

``gateway-peers`` gives CPU per chunk over whole loads, with a stream's start and end spread over its chunks (100 at
100 streams, 40 at 500). Here each target relays, in interleaved rounds, two loads from one backend
(bench/sse_source.py, a chunk every 20 ms): 2,000 streams of 2 chunks started evenly over 10 s (about 8 open at a
time), then 100 streams of 100 chunks started over 20 ms (``gateway-peers``' 100 streams). From the two, CPU per
chunk of a stream under way, ``(long - short) / 98``, and a stream's start and end, ``short - 2 * chunk``: each a
median over rounds of the target's CPU per stream; the same of its system time tells the kernel's part of each.
Every stream is checked byte for byte (bench/relay_client.py).

Target (on 2 cores): a stream's start and end at most the better router's.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

from bench.common import CpuMark, Result
from bench.gateway_peers import ROUNDS, SPOTDRAIN, client_run, floor, ours, started
from bench.peer_figures import Load
from bench.peer_routers import Missing, Peer, argv_for, routers
from simulate.fakes.processes import free_port

SHORT = Load("2,000 streams of 2 chunks", 2000, 2, 0.02, 1)
SHORT_SPREAD_S = 10.0
LONG = Load("100 streams of 100 chunks", 100, 100, 0.02, 2)


PerStream = tuple[float, float]  # µs of CPU per stream: all of it, and its system (kernel) part


async def _cpu_per_stream(pid: int, url: str, load: Load, *, spread_s: float) -> tuple[PerStream, int]:
    """µs of the target's CPU per stream of ``load`` (and of it in the kernel), and how many of its streams were not
    exact."""
    before = CpuMark.of(pid)
    _, _, exact, _ = await client_run(url, load, spread_s=spread_s)
    used, kernel = CpuMark.of(pid).since(before)
    return (used * 1e6 / load.streams, kernel * 1e6 / load.streams), load.streams - exact


async def _rounds(workdir: Path, proxies: list[Peer]) -> tuple[dict[str, list[tuple[PerStream, PerStream]]], int]:
    """Each proxy's µs per short and per long stream, a pair a round, and how many streams were not exact."""
    port = free_port()
    backend = f"http://127.0.0.1:{port}"
    source = [sys.executable, "-m", "bench.sse_source", "--port", str(port), "--interval", str(LONG.interval_s)]
    figures: dict[str, list[tuple[PerStream, PerStream]]] = {proxy.name: [] for proxy in proxies}
    wrong = 0
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(started(source, workdir / "backend.log", f"{backend}/health"))
        urls: dict[str, tuple[int, str]] = {}
        for n, proxy in enumerate(proxies):
            proxy_port = free_port()
            argv = argv_for(proxy, port=proxy_port, metrics_port=free_port(), backend=backend)
            health = f"http://127.0.0.1:{proxy_port}/health"
            process = await stack.enter_async_context(started(argv, workdir / f"proxy-{n}.log", health))
            urls[proxy.name] = (process.pid, f"http://127.0.0.1:{proxy_port}/v1/completions")
        for _, url in urls.values():
            await client_run(url, Load("warm", 50, 2, 0.02, 1), spread_s=1.0)
        for round_ in range(ROUNDS):
            turn = round_ % len(proxies)
            for proxy in proxies[turn:] + proxies[:turn]:
                pid, url = urls[proxy.name]
                short, short_wrong = await _cpu_per_stream(pid, url, SHORT, spread_s=SHORT_SPREAD_S)
                long, long_wrong = await _cpu_per_stream(pid, url, LONG, spread_s=LONG.interval_s)
                figures[proxy.name].append((short, long))
                wrong += short_wrong + long_wrong
    return figures, wrong


def split(short_us: float, long_us: float) -> tuple[float, float]:
    """A stream's start and end, and a chunk under way, in µs of CPU, from the CPU per short and per long stream."""
    chunk = (long_us - short_us) / (LONG.chunks - SHORT.chunks)
    return short_us - SHORT.chunks * chunk, chunk


def _split(pairs: list[tuple[PerStream, PerStream]], part: int) -> tuple[float, float]:
    """``split`` of the medians over rounds of the short and the long streams' CPU (``part`` 0: all; 1: the
    kernel's)."""
    short = statistics.median(short[part] for short, _ in pairs)
    return split(short, statistics.median(long[part] for _, long in pairs))


async def measure() -> list[Result]:
    found = routers()
    peers = [p for p in found if isinstance(p, Peer)]
    missing = [m for m in found if isinstance(m, Missing)]
    proxies = [ours(), ours(workers=1), floor(), *peers]
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-streams-") as name:
        figures, wrong = await _rounds(Path(name), proxies)
    medians = {proxy: _split(pairs, 0) for proxy, pairs in figures.items()}
    kernel = {proxy: _split(pairs, 1) for proxy, pairs in figures.items()}
    lines = [
        f"{proxy}: a stream's start and end {s:.0f} µs ({kernel[proxy][0]:.0f} in the kernel), a chunk {c:.1f} µs "
        f"({kernel[proxy][1]:.1f} in the kernel)"
        for proxy, (s, c) in medians.items()
    ]
    print("\n".join(lines), file=sys.stderr)
    detail = f"{'; '.join(lines)}; {ROUNDS} rounds"
    results = [Result("gateway_streams_not_exact", wrong, "streams", 0, wrong == 0, detail)]
    if not peers:
        reason = "; ".join(m.reason for m in missing) or "no router could be installed"
        return [*results, Result.skip("gateway_streams_start_end_ratio", "x", 1.0, reason)]
    better = min(peers, key=lambda p: medians[p.name][0])
    ratio = medians[SPOTDRAIN][0] / medians[better.name][0]
    against = f"against {better.name}"
    return [*results, Result("gateway_streams_start_end_ratio", round(ratio, 4), "x", 1.0, ratio <= 1.0, against)]
