"""A destination slower than the benchmark's source, for ``bench.cache_fetch``: ext4 on a loop device whose writes the
kernel's block throttle holds to a set rate.

The model-cache issue asks for a fetch within 10 % of the disk's write rate where the source is faster than the disk.
A local S3 server on the same two cores is rarely faster than this machine's disk, so the benchmark makes a disk that
is slower. The loop device writes to its image with direct I/O (``--direct-io=on``), so its bytes are not cached a
second time under the image, and the throttle (cgroup v1 ``blkio.throttle.write_bps_device``, set on the root group,
so it holds every writer of the device: the tools' writes and the kernel's writeback alike) is the one limit. The
filesystem's inode tables and journal are written out by ``mkfs``, so no background zeroing spends the device's rate.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

MIB = 1024**2
THROTTLE = Path("/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device")
TOOLS = ("losetup", "mkfs.ext4", "mount", "umount")


class Unavailable(Exception):
    """The limited disk cannot be made here; the message says why."""


def missing() -> str | None:
    """Why a limited disk cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "needs root, to attach a loop device, mount it and throttle its writes"
    if not THROTTLE.exists():
        return f"this kernel has no cgroup v1 write throttle at {THROTTLE} (under cgroup v2 alone it is not set up)"
    lacking = [name for name in TOOLS if shutil.which(name) is None]
    return f"{', '.join(lacking)} not installed" if lacking else None


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        raise Unavailable(f"{' '.join(argv[:2])} exited with {done.returncode}: {done.stderr.strip() or 'no output'}")
    return done.stdout.strip()


@contextmanager
def limited_disk(workdir: Path, size_bytes: int, mib_per_s: int) -> Iterator[Path]:
    """A new ext4 of ``size_bytes`` mounted under ``workdir``, its device's writes limited to ``mib_per_s``; all of it
    undone at the end. Unavailable, with the reason, when it cannot be made."""
    if (why := missing()) is not None:
        raise Unavailable(why)
    image, mountpoint = workdir / "limited-disk.img", workdir / "limited-disk"
    with ExitStack() as undo:
        with image.open("wb") as out:
            out.truncate(size_bytes)
        undo.callback(image.unlink, missing_ok=True)
        device = _run(["losetup", "--find", "--show", "--direct-io=on", str(image)])
        undo.callback(subprocess.run, ["losetup", "-d", device], capture_output=True, check=False)
        _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
        mountpoint.mkdir(exist_ok=True)
        _run(["mount", device, str(mountpoint)])
        undo.callback(subprocess.run, ["umount", str(mountpoint)], capture_output=True, check=False)
        numbers = f"{os.major(os.stat(device).st_rdev)}:{os.minor(os.stat(device).st_rdev)}"
        try:
            THROTTLE.write_text(f"{numbers} {mib_per_s * MIB}\n")
        except OSError as error:
            raise Unavailable(f"the write throttle at {THROTTLE} refused {numbers}: {error.strerror}") from None
        undo.callback(THROTTLE.write_text, f"{numbers} 0\n")
        yield mountpoint
