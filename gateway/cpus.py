"""How many workers the gateway runs by default: the CPUs its container may use.

A container's CPU limit is a CFS quota in its cgroup (v2: ``cpu.max``, "$MAX $PERIOD" in microseconds, ``max`` for
none; v1: ``cpu/cpu.cfs_quota_us`` and ``cpu/cpu.cfs_period_us``, -1 for none), not a number of CPUs it is shown:
``os.cpu_count()`` inside a pod limited to 2 CPUs is the node's 64.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(cpu_max: str) -> float | None:
    """CPUs a cgroup v2 ``cpu.max`` (``"$MAX $PERIOD"``) allows; None for no limit (``max``) or what is not one."""
    parts = cpu_max.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def workers_for(quota: float | None, cpus: int) -> int:
    """One worker per CPU the container may use: its quota rounded up, at most the CPUs it may run on."""
    cpus = max(1, cpus)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def default_workers(cgroup: Path = CGROUP) -> int:
    """The default of ``--workers``: from this container's cgroup quota (v2 ``cpu.max``, else v1's CFS files) and the
    CPUs this process may run on."""
    quota = None
    with contextlib.suppress(OSError):
        quota = cpu_quota((cgroup / "cpu.max").read_text())
    if quota is None:
        with contextlib.suppress(OSError):
            v1 = cgroup / "cpu"
            quota = cpu_quota(f"{(v1 / 'cpu.cfs_quota_us').read_text()} {(v1 / 'cpu.cfs_period_us').read_text()}")
    return workers_for(quota, len(os.sched_getaffinity(0)))
