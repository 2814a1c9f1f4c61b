"""The model cache on four 1 GiB loop devices: from start to the cache mounted and the node labelled (one disk, and a
RAID0 of four where the kernel has md), and the idempotent re-run on a ready node (target under 1 s)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.cache.plan import PENDING_TAINT, Outcome
from agent.cache.run import prepare_cache
from agent.cache.settings import CacheSettings
from agent.drain.nodes import KubeActions, NodeActions, api_client
from bench.common import Result, report
from simulate.fakes.kube import FakeKube
from spotdrain.logs import configure_logging
from spotdrain.ratelimit import RateLimiter

DISKS = 4
DISK_BYTES = 1024**3
FIRST_RUN_TARGET_S = 5.0
RERUN_TARGET_S = 1.0


class NoLoopDevice(Exception):
    """losetup could not attach a loop device here (no /dev/loop-control in a container, none left)."""


@contextmanager
def loop_devices(workdir: Path, count: int) -> Iterator[list[str]]:
    """Sparse files attached as loop devices; detached again at the end. NoLoopDevice when one cannot be had."""
    devices: list[str] = []
    try:
        for index in range(count):
            image = workdir / f"disk{index}.img"
            with image.open("wb") as file:
                file.truncate(DISK_BYTES)
            found = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True)
            if found.returncode != 0 or not found.stdout.strip():
                raise NoLoopDevice(f"losetup could not attach a loop device: {found.stderr.strip() or 'no output'}")
            devices.append(found.stdout.strip())
        yield devices
    finally:
        for device in devices:
            subprocess.run(["losetup", "-d", device], capture_output=True)


def _release(settings: CacheSettings) -> None:
    subprocess.run(["umount", str(settings.path)], capture_output=True)
    if os.path.exists(settings.array_path):
        subprocess.run(["mdadm", "--stop", settings.array_path], capture_output=True)


async def _timed(settings: CacheSettings, actions: NodeActions, node: str) -> tuple[float, Outcome]:
    started = time.perf_counter()
    result = await prepare_cache(settings, actions, node_name=node, metrics=None)
    return time.perf_counter() - started, result.outcome


async def _layout(name: str, devices: list[str], workdir: Path, kube: FakeKube, actions: NodeActions) -> list[Result]:
    kube.add_node(name, taints=[{"key": PENDING_TAINT, "effect": "NoSchedule"}])
    settings = CacheSettings(
        enabled=True,
        devices=",".join(devices),
        fs="xfs",
        path=workdir / name,
        force=False,
        state_dir=workdir / "state",
        name=f"bench-{name}",
    )
    try:
        first_s, outcome = await _timed(settings, actions, name)
        rerun_s, _ = await _timed(settings, actions, name)
    finally:
        _release(settings)
    detail = f"{len(devices)} of {DISKS} x 1 GiB loop devices, xfs; {outcome.value}"
    return [
        Result.below(f"cache_first_run_{name}", first_s, "s", FIRST_RUN_TARGET_S, f"mounted and labelled; {detail}"),
        Result.below(f"cache_rerun_{name}", rerun_s, "s", RERUN_TARGET_S, f"ready node, nothing written; {detail}"),
    ]


def _skipped(name: str, why: str) -> list[Result]:
    return [
        Result.skip(f"cache_first_run_{name}", "s", FIRST_RUN_TARGET_S, why),
        Result.skip(f"cache_rerun_{name}", "s", RERUN_TARGET_S, why),
    ]


def _missing() -> str | None:
    """Why the cache cannot be benchmarked here at all, or None."""
    if os.geteuid() != 0:
        return "needs root, to attach loop devices and mount them"
    lacking = [tool for tool in ("losetup", "mkfs.xfs") if shutil.which(tool) is None]
    return f"{' and '.join(lacking)} not installed here" if lacking else None


async def measure() -> list[Result]:
    why = _missing()
    if why is not None:
        return _skipped("single", why) + _skipped("raid0", why)
    md = Path("/proc/mdstat").exists() and shutil.which("mdadm") is not None
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-cache-") as tmp:
        workdir = Path(tmp)
        async with FakeKube() as kube, api_client(str(kube.write_kubeconfig(workdir / "kubeconfig"))) as api:
            actions = KubeActions(api, limiter=RateLimiter(qps=100, burst=100), on_error=lambda _: None)
            try:
                with loop_devices(workdir, DISKS) as devices:
                    results = await _layout("single", devices[:1], workdir, kube, actions)
                    if md:
                        results += await _layout("raid0", devices, workdir, kube, actions)
                    else:
                        results += _skipped("raid0", "no md driver (/proc/mdstat) or no mdadm on this machine")
            except NoLoopDevice as error:
                return _skipped("single", str(error)) + _skipped("raid0", str(error))
    return results


if __name__ == "__main__":
    configure_logging(json=False, level="warning")  # stdout carries the JSON report alone
    report(asyncio.run(measure()))
