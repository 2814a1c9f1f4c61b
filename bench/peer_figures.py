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

CPU_RATIO_TARGET = 1.0
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
    break_every: int = 0  # the backend drops one stream in this many halfway, for the gateway to continue (0: none)


LOADS = (
    Load("1 stream", 1, 200, 0.005, 1),
    Load("100 streams", 100, 100, 0.02, 2),
    Load("500 streams", 500, 40, 0.05, 2),
)
# The loads of 100 and 500 streams with one stream in ten broken halfway and continued: the gateway's alone (no
# router continues a stream), set beside the routers' figures of the unbroken load.
CONTINUED = tuple(
    Load(f"{load.name}, 1 in 10 continued", load.streams, load.chunks, load.interval_s, load.clients, break_every=10)
    for load in LOADS[1:]
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
    kernel_s: float | None = None  # of cpu_s, the system's part: the kernel's work for the target's calls

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)

    @property
    def cpu_per_chunk_us(self) -> float | None:
        return self._per_chunk_us(self.cpu_s)

    @property
    def kernel_per_chunk_us(self) -> float | None:
        return self._per_chunk_us(self.kernel_s)

    def _per_chunk_us(self, seconds: float | None) -> float | None:
        return None if seconds is None else seconds / max(1, len(self.latencies_ms)) * 1e6


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


def split_per_chunk_us(target: Target, load: str) -> tuple[float, float] | None:
    """The medians over rounds of the kernel's part of ``target``'s CPU per chunk and of the rest (the target's own
    code); None where a round has no split."""
    pairs = [(run.kernel_per_chunk_us, run.cpu_per_chunk_us) for run in target.runs[load]]
    known = [(kernel, whole) for kernel, whole in pairs if kernel is not None and whole is not None]
    if len(known) < len(pairs):
        return None
    return _median([kernel for kernel, _ in known]), _median([whole - kernel for kernel, whole in known])


def rounds_detail(direct: Target, rounds: int) -> str:
    loads = {name: [round(run.load_average, 2) for run in runs] for name, runs in direct.runs.items()}
    return f"{rounds} rounds; load average (1 min) at each round's start: {json.dumps(loads)}"


def table(targets: list[Target]) -> str:
    """The comparison as a Markdown table (latencies absolute, ms; CPU µs per chunk; RSS MB), then the continued
    loads' for the targets that ran them."""
    head = (
        "| proxy | 1 stream: p50 / p90 | 100 streams: p50 / p99 | 500 streams: p50 / p99 "
        "| CPU per chunk at 100 / 500 streams | RSS idle / peak |\n| --- | --- | --- | --- | --- | --- |"
    )
    rows = [head]
    for t in targets:
        one = f"{absolute(t, LOADS[0].name, 0.5):.2f} / {absolute(t, LOADS[0].name, 0.9):.2f} ms"
        rss = "—" if t.idle_mb is None else f"{t.idle_mb:.0f} / {t.peak_mb:.0f} MB"
        rows.append(f"| {t.name} | {one} | {_cells(t, LOADS[1:])} | {rss} |")
    continued = [t for t in targets if all(load.name in t.runs for load in CONTINUED)]
    if continued:
        rows += ["", "| proxy | " + " | ".join(f"{load.name}: p50 / p99" for load in CONTINUED) + " | CPU per chunk |"]
        rows += ["| --- | --- | --- | --- |"]
        rows += [f"| {t.name} | {_cells(t, CONTINUED)} |" for t in continued]
    split = [t for t in targets if t.pid is not None]
    if split:
        loads = " / ".join(load.name for load in LOADS[1:])
        rows += ["", f"| proxy | CPU per chunk in the kernel, {loads} | the rest (its own code), {loads} |"]
        rows += ["| --- | --- | --- |"]
        rows += [f"| {t.name} | {_split_cells(t)} |" for t in split]
    return "\n".join(rows)


def _split_cells(target: Target) -> str:
    """The kernel's part and the rest of the CPU per chunk, at each load with streams in the hundreds."""
    splits = [split_per_chunk_us(target, load.name) for load in LOADS[1:]]
    known = [split for split in splits if split is not None]
    if len(known) < len(splits):
        return "— | —"
    return " / ".join(f"{k:.1f}" for k, _ in known) + " µs | " + " / ".join(f"{r:.1f}" for _, r in known) + " µs"


def _cells(target: Target, loads: tuple[Load, ...]) -> str:
    """Each load's p50 / p99, then their CPU per chunk."""
    cells = [f"{absolute(target, load.name, 0.5):.2f} / {absolute(target, load.name, 0.99):.1f} ms" for load in loads]
    cpus = [cpu_per_chunk_us(target, load.name) for load in loads]
    cells.append("—" if None in cpus else " / ".join(f"{cpu:.1f}" for cpu in cpus if cpu is not None) + " µs")
    return " | ".join(cells)


def merged(by_load: dict[str, list[Target]]) -> list[Target]:
    """One target per name with every load's runs; memory as measured at the largest load."""
    largest = by_load[LOADS[-1].name]
    by_name = {target.name: target for target in largest}
    for targets in by_load.values():
        for target in targets:
            if target is not by_name[target.name]:
                by_name[target.name].runs.update(target.runs)
    return largest


def results(
    targets: list[Target],
    missing: list[Missing],
    *,
    ours: str,
    peers: list[str],
    floor: str | None,
    rounds: int,
    build: str = "",
) -> list[Result]:
    """The results: the target named ``ours`` against the ``peers`` measured; ``missing`` ones say why not. The
    ``floor`` target's CPU per chunk is given beside ours; ``build`` says how ours was run."""
    direct, gateway = targets[0], next(t for t in targets if t.name == ours)
    measured = [t for t in targets if t.name in peers]
    least = next((t for t in targets if t.name == floor), None)
    detail = rounds_detail(direct, rounds) + (f"; the gateway {build}" if build else "")
    out = [_exact(targets, detail)]
    one, five = LOADS[0].name, LOADS[2].name
    p90 = added(gateway, direct, one, 0.9)
    out.append(_at_most("gateway_peers_p90_added_1_stream", p90, "ms", P90_ADDED_1_TARGET_MS, detail))
    p50 = added(gateway, direct, five, 0.5)
    out.append(_at_most("gateway_peers_p50_added_500_streams", p50, "ms", P50_ADDED_500_TARGET_MS, detail))
    out += _ratios(gateway, direct, measured, missing, detail, floor=least)
    out += _beside_routers(gateway, direct, measured, detail)
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


def _beside_routers(ours: Target, direct: Target, peers: list[Target], rounds: str) -> list[Result]:
    """At 500 streams, plain and with streams continued, and at 100 continued: CPU per chunk as a ratio to the better
    router's in the same rounds (where they ran: else at the same number of unbroken streams), and p50 and p99 added
    over the better router's (ms)."""
    if not peers:
        return []
    out = []
    for load, plain in ((LOADS[2], LOADS[2]), *zip(CONTINUED, LOADS[1:], strict=True)):
        if load.name not in ours.runs:
            continue
        prefix = "gateway_peers_" + ("continued_" if load.break_every else "")
        streams = f"{load.streams}_streams"
        theirs_at = {t.name: load.name if load.name in t.runs else plain.name for t in peers}
        cpu = {t.name: cpu_per_chunk_us(t, theirs_at[t.name]) or 0.0 for t in peers}
        best = min(peers, key=lambda t: cpu[t.name])
        mine = cpu_per_chunk_us(ours, load.name) or 0.0
        detail = f"{mine:.1f} µs ({load.name}) against {best.name}'s {cpu[best.name]:.1f} ({theirs_at[best.name]})"
        detail += f"; {rounds}"
        out.append(_at_most(f"{prefix}cpu_per_chunk_ratio_{streams}", mine / cpu[best.name], "x", 1.0, detail))
        if load.streams != LOADS[2].streams:
            continue
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            theirs = {t.name: _added_beside(t, direct, theirs_at[t.name], plain.name, q) for t in peers}
            best_name = min(theirs, key=lambda name: theirs[name])
            mine = _added_beside(ours, direct, load.name, plain.name, q)
            detail = f"{mine:.2f} ms added ({load.name}) against {best_name}'s {theirs[best_name]:.2f}; {rounds}"
            name = f"{prefix}{label}_added_{streams}_over_router"
            out.append(_at_most(name, mine - theirs[best_name], "ms", 0.0, detail))
    return out


def _added_beside(ours: Target, direct: Target, load: str, plain: str, q: float) -> float:
    """What ours added at ``load`` to the direct streams of ``plain`` (the continued loads' own where direct ran
    them: the backend breaks none of the streams that did not ask for token ids)."""
    return (
        added(ours, direct, load, q)
        if load in direct.runs
        else _median([r.p(q) for r in ours.runs[load]]) - (_median([r.p(q) for r in direct.runs[plain]]))
    )
