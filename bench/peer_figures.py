"""bench/gateway_peers.py's figures, from what its rounds measured: pure, no I/O.

A figure is the median over rounds; "added" is a target's percentile less the direct one of the same round.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field

from bench.common import Result
from bench.gateway import percentile
from bench.peer_routers import Missing

CPU_RATIO_TARGET = 1.5
P99_RATIO_TARGET = 2.0
P50_ADDED_500_TARGET_MS = 5.0
P90_ADDED_1_TARGET_MS = 0.5
IDLE_RSS_TARGET_MB = 60.0
PER_STREAM_TARGET_KB = 20.0
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


def rounds_detail(direct: Target, rounds: int) -> str:
    loads = {name: [round(run.load_average, 2) for run in runs] for name, runs in direct.runs.items()}
    return f"{rounds} rounds; load average (1 min) at each round's start: {json.dumps(loads)}"


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


def results(
    targets: list[Target], missing: list[Missing], *, ours: str, peers: list[str], floor: str | None, rounds: int
) -> list[Result]:
    """The results: the target named ``ours`` against the ``peers`` measured; ``missing`` ones say why not. The
    ``floor`` target's CPU per chunk is given beside ours."""
    direct, gateway = targets[0], next(t for t in targets if t.name == ours)
    measured = [t for t in targets if t.name in peers]
    least = next((t for t in targets if t.name == floor), None)
    detail = rounds_detail(direct, rounds)
    out = [_exact(targets, detail)]
    one, five = LOADS[0].name, LOADS[2].name
    p90 = added(gateway, direct, one, 0.9)
    out.append(_at_most("gateway_peers_p90_added_1_stream", p90, "ms", P90_ADDED_1_TARGET_MS, detail))
    p50 = added(gateway, direct, five, 0.5)
    out.append(_at_most("gateway_peers_p50_added_500_streams", p50, "ms", P50_ADDED_500_TARGET_MS, detail))
    out += _ratios(gateway, direct, measured, missing, detail, floor=least)
    assert gateway.idle_mb is not None
    assert gateway.per_process_idle_mb is not None
    per_stream = (gateway.peak_mb - gateway.idle_mb) * 1024 / LOADS[-1].streams
    detail = f"largest process {gateway.per_process_idle_mb:.1f} MB of {gateway.idle_mb:.1f} MB in all, after start"
    idle = gateway.per_process_idle_mb
    out.append(_at_most("gateway_peers_rss_idle_per_process", idle, "MB", IDLE_RSS_TARGET_MB, detail))
    detail = (
        f"peak {gateway.peak_mb:.1f} MB over {LOADS[-1].streams} streams, {gateway.idle_mb:.1f} MB idle (all processes)"
    )
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


def _ratios(
    ours: Target, direct: Target, peers: list[Target], missing: list[Missing], rounds: str, *, floor: Target | None
) -> list[Result]:
    load = LOADS[1].name
    names = ("gateway_peers_cpu_per_chunk_ratio_100_streams", "gateway_peers_p99_ratio_100_streams")
    if not peers:
        why = "; ".join(f"{m.name}: {m.reason}" for m in missing) or "no peer router"
        return [Result.skip(names[0], "x", CPU_RATIO_TARGET, why), Result.skip(names[1], "x", P99_RATIO_TARGET, why)]
    cpu = {t.name: cpu_per_chunk_us(t, load) or 0.0 for t in (ours, *peers, *([floor] if floor else []))}
    best_cpu = min(peers, key=lambda t: cpu[t.name])
    # A Python proxy that parses nothing: how far below ours a Python relay can go at all.
    beside = f"; {floor.name} {cpu[floor.name] / cpu[best_cpu.name]:.2f} times as much" if floor else ""
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
            f"against {best_cpu.name}; CPU per chunk: {cpu_detail}{beside}; {rounds}",
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
