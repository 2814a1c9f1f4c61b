"""What the end-to-end tier's nodes leave on the machine, found by where they put it and removed: processes in the
nodes' network namespaces, in their pods' cgroups or started from the run's directory; mounts under the store;
the namespaces (with their veths); the cgroup trees under each node's ``cgroupRoot``, deepest first. It runs after
every stop and before every start, so a killed run's leftovers go too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from tests.install import network

CGROUPS = Path("/sys/fs/cgroup")
LOG_LINKS = Path("/var/log/containers")
# Paths the kubelet and containerd use whatever their directories (../shared/kube/README.md): removed after a run
# that made them.
FIXED = (Path("/var/lib/kubelet"), Path("/run/containerd"), LOG_LINKS)
MADE = "paths-made"  # in the store: the paths a run made, removed when it stops
SHARED = "shared-mounts"  # in the store: the paths a run made shared mount points


def stop_process(process: subprocess.Popen[bytes], within_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited ``within_s`` seconds later."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(within_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def make_cgroup_root(path: str) -> None:
    """Make the kubelet's ``cgroupRoot`` in every hierarchy (it refuses one that does not exist); a new cpuset
    cgroup has no CPUs or memory nodes until given its parent's."""
    for hierarchy in _hierarchies():
        target = hierarchy / path.lstrip("/")
        target.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (hierarchy / name).exists() and not (target / name).read_text().strip():
                (target / name).write_text((hierarchy / name).read_text())


def sweep(store: Path, *, keep_logs: bool = False) -> None:
    """Remove what the run in ``store`` left; its directory too unless ``keep_logs`` (nothing in it is mounted
    or running any more)."""
    run = store / "run"
    _kill(_leftover_pids(run))
    _unmount_under(store)
    for shared in _noted(store, SHARED):
        _unmount_under(Path(shared), itself=True)
    (store / SHARED).unlink(missing_ok=True)
    for device in _loops(store):
        subprocess.run(["losetup", "--detach", device], capture_output=True, timeout=30)
    for name in network.namespaces():
        network.remove(name)
    for hierarchy in _hierarchies():
        for root in hierarchy.glob(f"{network.PREFIX}*"):
            _remove_tree(root)
    for link in _log_links(store):
        link.unlink(missing_ok=True)
    if not keep_logs and not _mounts_under(run):  # rmtree would go on into whatever is still mounted
        shutil.rmtree(run, ignore_errors=True)


def note_fixed_paths(store: Path) -> None:
    """Write down which of the fixed paths are not there yet (kept in ``store`` across a killed run)."""
    _note(store, MADE, [path for path in FIXED if not path.exists()])


def share(store: Path, path: Path) -> None:
    """Make ``path`` a mount point of its own and shared, as a hostPath under a ``mountPropagation:
    Bidirectional`` volume must be (``/`` is private here): bound on itself and made rshared. Noted in ``store``,
    so that the sweep unmounts it and all pods mounted under it, and removes it if this made it."""
    if not path.exists():
        _note(store, MADE, [path])
        path.mkdir(parents=True)
    _note(store, SHARED, [path])
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True, capture_output=True, timeout=30)
    subprocess.run(["mount", "--make-rshared", str(path)], check=True, capture_output=True, timeout=30)


def remove_made_paths(store: Path) -> None:
    """Remove the fixed paths and shared mount points a run made (nothing in them is mounted or running any
    more)."""
    kept = [Path(path) for path in _noted(store, MADE) if _mounts_under(Path(path), itself=True)]
    for path in _noted(store, MADE):
        if Path(path) not in kept:  # rmtree would go on into whatever is still mounted
            shutil.rmtree(path, ignore_errors=True)
    (store / MADE).unlink(missing_ok=True)
    _note(store, MADE, kept)


def _noted(store: Path, name: str) -> list[str]:
    return (store / name).read_text().split() if (store / name).exists() else []


def _note(store: Path, name: str, paths: list[Path]) -> None:
    noted = sorted({*_noted(store, name), *(str(path) for path in paths)})
    (store / name).write_text("".join(f"{path}\n" for path in noted))


def leftovers(store: Path) -> list[str]:
    """What a run in ``store`` left on the machine: each process, mount, log link, namespace, veth, cgroup tree and
    loop device still there, described."""
    found = [f"process {pid}: {_cmdline(pid)}" for pid in sorted(_leftover_pids(store / "run"))]
    found += [f"mount {point}" for point in _mounts_under(store)]
    found += [f"mount {point}" for shared in _noted(store, SHARED) for point in _mounts_under(Path(shared), True)]
    found += [f"log link {link}" for link in _log_links(store)]
    found += [f"network namespace {name}" for name in network.namespaces()]
    found += [f"link {link.name}" for link in Path("/sys/class/net").glob(f"{network.LINK_PREFIX}*")]
    for hierarchy in _hierarchies():
        found += [f"cgroup {root}" for root in hierarchy.glob(f"{network.PREFIX}*")]
    found += [f"loop device {device}" for device in _loops(store)]
    found += [f"path {path}" for path in _noted(store, MADE) if Path(path).exists()]
    return found


def _loops(store: Path) -> list[str]:
    """The loop devices over files in ``store``."""
    argv = ["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"]
    listed = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listed.splitlines() if f" {store}/" in line]


def _log_links(store: Path) -> list[Path]:
    """The kubelet's links to its containers' logs in the fixed ``/var/log/containers`` that lead into ``store``."""
    if not LOG_LINKS.is_dir():
        return []
    return [link for link in LOG_LINKS.iterdir() if link.is_symlink() and str(link.readlink()).startswith(f"{store}/")]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "(exited)"


def _hierarchies() -> list[Path]:
    return [path for path in CGROUPS.iterdir() if path.is_dir() and (path / "cgroup.procs").exists()]


def _leftover_pids(run: Path) -> set[int]:
    pids: set[int] = set()
    for name in network.namespaces():
        pids.update(network.pids_in(name))
    for hierarchy in _hierarchies():
        for procs in hierarchy.glob(f"{network.PREFIX}*/**/cgroup.procs"):
            pids.update(int(pid) for pid in procs.read_text().split())
    marker = str(run).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue  # exited meanwhile
    pids.discard(os.getpid())
    return pids


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    give_up = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in pids) and time.monotonic() < give_up:
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _mounts_under(root: Path, itself: bool = False) -> list[str]:
    points = (line.split()[4].replace("\\040", " ") for line in Path("/proc/self/mountinfo").read_text().splitlines())
    return [point for point in points if point.startswith(f"{root}/") or (itself and point == str(root))]


def _unmount_under(root: Path, *, itself: bool = False) -> None:
    for _ in range(5):  # an unmount may uncover another mount at the same point
        points = _mounts_under(root, itself)
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            done = subprocess.run(["umount", point], capture_output=True, timeout=30)
            if done.returncode != 0:
                subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30)


def _remove_tree(root: Path) -> None:
    for directory, _, _ in sorted(os.walk(root), key=lambda entry: len(entry[0]), reverse=True):
        with contextlib.suppress(OSError):  # a cgroup still holding a process: leftovers() reports it
            os.rmdir(directory)
