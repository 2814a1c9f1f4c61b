"""What bench/cache_fetch.py's rows are and the issue's targets judged from them: ours against s5cmd for each kind
of source checksum, against the disk's write rate, and its resident set; and the table as text with each verdict.
Pure functions of the table."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from bench import fetch_peers
from bench.common import Result

S5CMD_RATIO_TARGET = 1.0
DISK_SHARE_TARGET = 0.9
RSS_TARGET_MB = 150.0

# What the source gives a fetch to check each file against: MD5 ETags only (an object uploaded without a checksum),
# or a CRC64NVME beside them (every object S3 stored since December 2024, unless asked for another algorithm).
MD5_ETAG, CRC64NVME = "md5 etag", "crc64nvme"
SOURCE_CHECKSUMS = (MD5_ETAG, CRC64NVME)


LIMITED, LIMITED_WRITE = "default, limited disk", "sequential write, limited disk"
ONE_GET, EVERY_GET = "one GET (curl)", "every object at once (curl --parallel)"


@dataclass
class Row:
    tool: str
    config: str
    flags: str = ""
    version: str = ""
    seconds: float | None = None
    mib_per_s: float | None = None
    cpu_s_per_gib: float | None = None
    peak_rss_mb: float | None = None
    verified: bool | None = None
    skipped: str | None = None
    runs_s: list[float] = field(default_factory=list)
    detail: str = ""
    source: str = ""  # a tool row's source checksum (SOURCE_CHECKSUMS)
    transfer_s: float | None = None  # ours, in its best run: from its listing to the model published, by its log
    server_cpu_s: float | None = None  # the source server's CPU seconds in the best run


def _ours_best(table: list[Row], *, on_limited: bool = False) -> Row | None:
    """Ours at its fastest, on the destination or (``on_limited``) on the limited disk."""
    measured = [
        r for r in table if r.tool == "spotdrain" and (r.config == LIMITED) == on_limited and r.mib_per_s is not None
    ]
    return max(measured, key=lambda r: r.mib_per_s or 0.0, default=None)


def targets(table: list[Row]) -> list[Result]:
    """The issue's targets, each judged only where both of its figures were measured: against s5cmd once for each
    kind of source checksum, the others over every run."""
    by = {(r.tool, r.config, r.source): r for r in table}
    results = [_versus_s5cmd(by, config, source) for source in SOURCE_CHECKSUMS for config in ("default", "tuned")]
    results.append(_versus_disk(by, table))
    ours = [r for r in table if r.tool == "spotdrain" and r.peak_rss_mb is not None]
    if not ours:
        why = _why_not(by.get(("spotdrain", "default", MD5_ETAG)))
        results.append(Result.skip("cache_fetch_peak_rss", "MB", RSS_TARGET_MB, why))
    else:
        rss = max(r.peak_rss_mb or 0.0 for r in ours)
        detail = "the largest resident set of spotdrain cache fetch in any run, default and tuned, either source"
        results.append(Result("cache_fetch_peak_rss", rss, "MB", RSS_TARGET_MB, rss <= RSS_TARGET_MB, detail))
    prefetches = [r for r in table if r.tool == fetch_peers.PREFETCH and r.peak_rss_mb is not None]
    if not prefetches:
        why = _why_not(by.get((fetch_peers.PREFETCH, "default", MD5_ETAG)))
        results.append(Result.skip("model_prefetch_peak_rss", "MB", RSS_TARGET_MB, why))
    else:
        rss = max(r.peak_rss_mb or 0.0 for r in prefetches)
        detail = "the largest resident set of spotdrain cache prefetch --once (the Kubernetes client loaded) in any run"
        results.append(Result("model_prefetch_peak_rss", rss, "MB", RSS_TARGET_MB, rss <= RSS_TARGET_MB, detail))
    return results


def _why_not(row: Row | None) -> str:
    return row.skipped if row is not None and row.skipped else "not measured"


def _versus_s5cmd(by: dict[tuple[str, str, str], Row], config: str, source: str) -> Result:
    name = f"cache_fetch_vs_s5cmd_{config}" + ("" if source == MD5_ETAG else f"_{source}")
    ours, theirs = by.get(("spotdrain", config, source)), by.get(("s5cmd", config, source))
    if ours is None or ours.mib_per_s is None:
        return Result.skip(name, "x", S5CMD_RATIO_TARGET, f"ours: {_why_not(ours)}")
    if theirs is None or theirs.mib_per_s is None:
        return Result.skip(name, "x", S5CMD_RATIO_TARGET, f"s5cmd: {_why_not(theirs)}")
    ratio = ours.mib_per_s / theirs.mib_per_s
    detail = f"ours {ours.mib_per_s} MiB/s, s5cmd {theirs.mib_per_s} MiB/s, each {config}, the source giving {source}"
    md5 = by.get(("checksum", "md5", ""))
    if source == MD5_ETAG and ratio < S5CMD_RATIO_TARGET and md5 is not None:
        detail += _md5_floor(theirs, md5)
    return Result(name, round(ratio, 3), "x", S5CMD_RATIO_TARGET, ratio >= S5CMD_RATIO_TARGET, detail)


def _md5_floor(s5cmd: Row, md5: Row) -> str:
    """The least time any fetch that checks the MD5 could take on this machine's cores, measured in this run: the MD5
    of the whole model, a transfer as cheap as s5cmd's, and the server's work as in s5cmd's run, all on the cores."""
    if None in (s5cmd.seconds, s5cmd.mib_per_s, s5cmd.cpu_s_per_gib, s5cmd.server_cpu_s, md5.cpu_s_per_gib):
        return ""
    cores = os.cpu_count() or 1
    gib = (s5cmd.seconds or 0) * (s5cmd.mib_per_s or 0) / 1024
    md5_cpu, moved_cpu = (md5.cpu_s_per_gib or 0) * gib, (s5cmd.cpu_s_per_gib or 0) * gib
    floor_s = (md5_cpu + moved_cpu + (s5cmd.server_cpu_s or 0)) / cores
    return (
        f"; on these {cores} cores, a fetch that checks the MD5 ({md5_cpu:.2f} CPU s) and moves the bytes as cheaply"
        f" as s5cmd ({moved_cpu:.2f}), the server spending what it spent for s5cmd ({s5cmd.server_cpu_s:.2f}),"
        f" needs {floor_s:.2f} s at the least: {(s5cmd.seconds or 0) / floor_s:.2f} x s5cmd at best"
    )


def _versus_disk(by: dict[tuple[str, str, str], Row], table: list[Row]) -> Result:
    """Ours at its best against the destination's own write rate where the source is faster than it; else on the
    limited disk, against that disk's rate, where it was measured."""
    name = "cache_fetch_share_of_disk_write"
    disk = by.get(("disk", "sequential write", ""))
    gets = (by.get(("source", ONE_GET, "")), by.get(("source", EVERY_GET, "")))
    sources = [r.mib_per_s for r in gets if r and r.mib_per_s]
    ours = _ours_best(table)
    if ours is None:
        why = _why_not(by.get(("spotdrain", "default", MD5_ETAG)))
        return Result.skip(name, "x", DISK_SHARE_TARGET, f"ours: {why}")
    if disk is None or disk.mib_per_s is None or not sources:
        return Result.skip(name, "x", DISK_SHARE_TARGET, "the disk's or the source's rate was not measured")
    detail = ""
    if max(sources) <= disk.mib_per_s:
        slower = f"the source ({max(sources)} MiB/s) is not faster than the disk ({disk.mib_per_s} MiB/s)"
        disk, ours = by.get(("disk", LIMITED_WRITE, "")), _ours_best(table, on_limited=True)
        if disk is None or disk.mib_per_s is None:
            return Result.skip(name, "x", DISK_SHARE_TARGET, f"{slower}; and no slower disk: {_why_not(disk)}")
        if ours is None:
            why = _why_not(by.get(("spotdrain", LIMITED, MD5_ETAG)))
            return Result.skip(name, "x", DISK_SHARE_TARGET, f"{slower}; ours on a slower disk: {why}")
        peers = [r for r in table if r.tool == "s5cmd" and r.config == LIMITED and r.mib_per_s is not None]
        detail = f"; {slower}, so on a disk held below both" + "".join(
            f"; s5cmd there {r.mib_per_s} MiB/s ({r.source})" for r in peers
        )
    share = (ours.mib_per_s or 0.0) / (disk.mib_per_s or 1.0)
    if ours.transfer_s and ours.seconds and disk.seconds:
        detail += (
            f"; of ours' {ours.seconds} s, the transfer from its listing to the model published took"
            f" {ours.transfer_s} s ({disk.seconds / ours.transfer_s:.3f} of the disk's rate), the rest was its start"
            " and listing"
        )
    detail = f"ours {ours.mib_per_s} MiB/s ({ours.config}, {ours.source}), the disk {disk.mib_per_s} MiB/s" + detail
    return Result(name, round(share, 3), "x", DISK_SHARE_TARGET, share >= DISK_SHARE_TARGET, detail)


def table_text(doc: dict[str, Any]) -> str:
    """The rows side by side, then each target with its verdict."""
    head = ("tool", "config", "source", "s", "MiB/s", "CPU s/GiB", "peak RSS MB", "verified", "flags / why skipped")
    lines = [head]
    for row in doc["rows"]:
        cells = [row["seconds"], row["mib_per_s"], row["cpu_s_per_gib"], row["peak_rss_mb"]]
        shown = ["-" if value is None else str(value) for value in cells]
        verified = {True: "yes", False: "NO", None: "-"}[row["verified"]]
        lines.append((row["tool"], row["config"], row["source"], *shown, verified, row["skipped"] or row["flags"]))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1]
        for line in lines
    ]
    out.append("")
    for result in doc["results"]:
        verdict = "skipped: " + result["skipped"] if result["skipped"] else ("pass" if result["passed"] else "MISSED")
        value = "" if result["value"] is None else f"{result['value']} {result['unit']} (target {result['target']}) "
        out.append(f"{result['name']}: {value}{verdict}")
    return "\n".join(out)
