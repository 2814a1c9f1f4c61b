"""The model-fetch benchmark's slower disk holds its writes to the rate it was given and leaves nothing behind; where it
cannot be made, it says why.

Run in processes of their own: importing ``bench`` configures logging for a benchmark's standard output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
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


def run_code(code: str, *args: str, env: dict[str, str] | None = None) -> Any:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


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
