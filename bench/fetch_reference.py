"""The reference measures of bench/cache_fetch.py, which say which side is the bottleneck: the page cache written
back and dropped, the destination's own sequential write rate, the source's rate for plain GETs (curl), and what each
kind of checksum a fetch checks a file against costs a core; and the reference rows made of them, with the slower
disk made where the source is not faster than the destination."""

from __future__ import annotations

import mmap
import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

from agent.cache.fetch.sources import Checksum, RemoteFile
from agent.cache.fetch.verify import Digest
from bench.fetch_peers import Ran, run_measured
from bench.fetch_targets import EVERY_GET, LIMITED_WRITE, ONE_GET, Row
from bench.limited_disk import Unavailable, limited_disk
from bench.s3_source import BUCKET, MIB, PREFIX, REGION, Model, Server

GIB = 1024**3
WRITE_BLOCK = 16 * MIB
WRITES = "16 MiB writes, then fsync: the faster of through the page cache and O_DIRECT"


def drop_page_cache() -> bool:
    """Write dirty pages back and drop the clean ones; whether the kernel let this process drop them."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


def warm(files: list[Path]) -> None:
    buffer = bytearray(WRITE_BLOCK)
    for path in files:
        with path.open("rb", buffering=0) as file:
            while file.readinto(buffer):
                pass


def disk_write_s(dest: Path, total_bytes: int, settle: Callable[[], None]) -> float:
    """Seconds to write ``total_bytes`` in 16 MiB writes to a new file in ``dest`` and fsync it: the faster of
    writing through the page cache and with ``O_DIRECT`` (the disk's own rate, where the filesystem takes it), each
    after ``settle`` (the page cache written back, and dropped)."""
    path = dest / "disk-reference"
    block = mmap.mmap(-1, WRITE_BLOCK)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(WRITE_BLOCK))
    times = []
    for flags in (0, getattr(os, "O_DIRECT", 0)):
        settle()
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
        try:
            for offset in range(0, total_bytes, WRITE_BLOCK):
                os.write(fd, memoryview(block)[: min(WRITE_BLOCK, total_bytes - offset)])
            os.fsync(fd)
            times.append(time.perf_counter() - started)
        except OSError:  # O_DIRECT refused (tmpfs, or a size not a multiple of the disk's block): the other counts
            if not flags:
                raise
        finally:
            os.close(fd)
            path.unlink()
    return min(times)


def source_get(server: Server, source: Model, log: Path, *, every: bool) -> tuple[Ran, int] | str:
    """Plain GETs with curl, signed with the server's keys: of the largest object, or (``every``) of every object at
    once (``curl --parallel``); the run and the bytes it fetched, or why it could not be made."""
    curl = shutil.which("curl")
    if curl is None:
        return "curl is not installed here"
    names = sorted(source.sizes) if every else [max(source.sizes, key=lambda n: source.sizes[n])]
    argv = [curl, "-sSf", "--max-time", "600", "--aws-sigv4", f"aws:amz:{REGION}:s3"]
    argv += ["--user", f"{server.access_key}:{server.secret_key}"]
    if every:
        argv += ["--parallel", "--parallel-max", str(len(names))]
    for name in names:
        argv += ["-o", os.devnull, f"{server.url}/{BUCKET}/{PREFIX}{name}"]
    ran = run_measured(argv, env=dict(os.environ), log_path=log, timeout_s=620)
    if ran.returncode != 0:
        return f"curl exited with {ran.returncode}: {log_tail(log)}"
    return ran, sum(source.sizes[name] for name in names)


def log_tail(log: Path) -> str:
    lines = log.read_text(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:]) if lines else "no output"


CHECKSUM_KINDS = ("md5", "sha256", "crc32", "crc32c", "crc64nvme")


def checksum_rows(source: Model) -> list[Row]:
    """What checking costs: each kind of checksum a fetch can check a file against, fed by the fetch's own code
    (``Digest``) over the largest file of the source from the page cache, on one core."""
    path = max(source.files, key=lambda f: f.stat().st_size)
    size = path.stat().st_size
    warm([path])
    rows = []
    for kind in CHECKSUM_KINDS:
        fd = os.open(path, os.O_RDONLY)
        try:
            digest = Digest(RemoteFile(path.name, size, (Checksum(kind, ""),)))
            started, cpu = time.perf_counter(), time.process_time()
            digest.feed(fd, size)
            seconds, used = time.perf_counter() - started, time.process_time() - cpu
        finally:
            os.close(fd)
        row = Row("checksum", kind, f"spotdrain's check of {size / MIB:.0f} MiB, one core", verified=None)
        row.seconds, row.mib_per_s = round(seconds, 3), round(size / MIB / seconds, 1)
        row.cpu_s_per_gib = round(used / (size / GIB), 3)
        rows.append(row)
    return rows


class RunOptions(Protocol):
    @property
    def total_bytes(self) -> int: ...
    @property
    def runs(self) -> int: ...
    @property
    def limited_mib_s(self) -> int | None: ...


class Bench(Protocol):
    """What the reference rows need of a benchmark run (bench.cache_fetch.Bench), named here so that this module
    does not import the one that imports it."""

    dest: Path
    source: Model
    limited: Path | None
    limited_writes: list[float]

    @property
    def options(self) -> RunOptions: ...

    def settle(self) -> None: ...


def reference_rows(bench: Bench, server: Server | None, why_no_server: str) -> list[Row]:
    total = bench.options.total_bytes
    writes = []
    for _ in range(bench.options.runs):
        writes.append(disk_write_s(bench.dest, total, bench.settle))
    disk = Row("disk", "sequential write", WRITES, verified=None)
    disk.seconds, disk.runs_s = round(min(writes), 3), [round(s, 3) for s in writes]
    disk.mib_per_s = round(total / MIB / min(writes), 1)
    one = source_row(bench, server, why_no_server, every=False)
    every = source_row(bench, server, why_no_server, every=True)
    return [disk, one, every, *checksum_rows(bench.source)]


def limit_disk(bench: Bench, reference: list[Row], stack: ExitStack) -> int | str:
    """Where the source is not faster than the destination, a disk limited to half the slower of the two (or, in
    any case, to ``--limited-disk``), made and set as ``bench.limited`` (undone with ``stack``): its rate in MiB/s,
    or why there is none."""
    by = {(r.tool, r.config): r for r in reference}
    disk = by[("disk", "sequential write")].mib_per_s
    sources = [rate for r in (by[("source", ONE_GET)], by[("source", EVERY_GET)]) if (rate := r.mib_per_s)]
    if disk is None or not sources:
        return "the disk's or the source's rate was not measured"
    if bench.options.limited_mib_s is not None:
        rate = bench.options.limited_mib_s
    elif max(sources) > disk:
        return f"not needed: the source ({max(sources)} MiB/s) is faster than the disk ({disk} MiB/s)"
    else:
        rate = max(16, int(min(max(sources), disk) / 2))
    size = bench.options.total_bytes * 5 // 4 + 256 * MIB  # a copy, the reference's file beside it, and ext4's own
    try:
        bench.limited = stack.enter_context(limited_disk(bench.dest, size, rate))
    except Unavailable as error:
        return f"no disk slower than the source could be made: {error}"
    return rate


def limited_row(bench: Bench, limit: int | str) -> Row:
    row = Row("disk", LIMITED_WRITE, verified=None)
    if isinstance(limit, str):
        row.skipped = limit
        return row
    writes = bench.limited_writes
    if not writes:
        row.skipped = "not measured"
        return row
    row.flags = f"ext4 on a loop device, its writes held to {limit} MiB/s; {WRITES}, between runs"
    row.seconds, row.runs_s = round(min(writes), 3), [round(s, 3) for s in writes]
    row.mib_per_s = round(bench.options.total_bytes / MIB / min(writes), 1)
    return row


def source_row(bench: Bench, server: Server | None, why_no_server: str, *, every: bool) -> Row:
    row = Row("source", EVERY_GET if every else ONE_GET)
    if server is None:
        row.skipped = why_no_server
        return row
    gets: list[tuple[Ran, int]] = []
    for run in range(bench.options.runs):
        bench.settle()
        warm(bench.source.files)
        got = source_get(server, bench.source, bench.dest / f"curl-{int(every)}-{run}.log", every=every)
        if isinstance(got, str):
            row.skipped = got
            return row
        gets.append(got)
    best, size = min(gets, key=lambda g: g[0].exit_s)
    row.flags = (
        f"{len(bench.source.sizes)} objects, {size / MIB:.0f} MiB" if every else f"the largest, {size / MIB:.0f} MiB"
    )
    row.seconds, row.mib_per_s = round(best.exit_s, 3), round(size / MIB / best.exit_s, 1)
    row.runs_s = [round(ran.exit_s, 3) for ran, _ in gets]
    row.version = server.version
    return row
