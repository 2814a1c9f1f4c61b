"""One result format for every benchmark: name, value, unit, target and whether it was met, or why it was skipped.

A benchmark that cannot run here reports no figure: its value and ``passed`` are null and ``skipped`` says why, so
a skipped result neither passes nor fails, and can never be read as a measurement.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Result:
    name: str
    value: float | None  # None: nothing was measured (skipped)
    unit: str
    target: float
    passed: bool | None  # None: skipped
    detail: str = ""
    skipped: str | None = None  # why it could not run here

    @classmethod
    def below(cls, name: str, value: float, unit: str, target: float, detail: str = "") -> Result:
        return cls(name, round(value, 4), unit, target, value < target, detail)

    @classmethod
    def skip(cls, name: str, unit: str, target: float, why: str) -> Result:
        return cls(name, None, unit, target, None, f"skipped: {why}", skipped=why)


def missed(results: list[Result]) -> bool:
    """Whether a measured result missed its target; skipped ones miss nothing."""
    return any(result.passed is False for result in results)


def report(results: list[Result]) -> None:
    json.dump([asdict(r) for r in results], sys.stdout, indent=2)
    print()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds a process has used so far."""
    return sum(cpu_split_s(pid))


def cpu_split_s(pid: int) -> tuple[float, float]:
    """The user and the system CPU seconds a process has used so far (``utime``, ``stime``: proc(5))."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def pss_mb(pid: int, *, proc: Path = Path("/proc")) -> float | None:
    """Proportional set size in MiB, from ``smaps_rollup`` (Linux 4.14 and later); None where the kernel has none,
    so that no figure stands in for one it could not read."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except FileNotFoundError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return None


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    found = [pid]
    for child in _children(pid):
        found += tree(child)
    return found


def _children(pid: int) -> list[int]:
    children: list[int] = []
    with suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with suppress(OSError):  # a thread that ended meanwhile
                children += [int(x) for x in (task / "children").read_text().split()]
    return children


SCHEDSTAT = Path("/proc/self/schedstat").exists()  # a kernel with CONFIG_SCHED_INFO, as distributions build
TICKS_ROUNDING_S = 3 / os.sysconf("SC_CLK_TCK")  # utime and stime each rounded down, at two marks


@dataclass(frozen=True)
class CpuMark:
    """What a process tree had used at one moment: each process's ``utime`` and ``stime`` (clock ticks, its ended
    threads included) and each live thread's time on a CPU, to the nanosecond (the first field of
    ``/proc/PID/task/TID/schedstat``). ``/proc/PID/stat`` counts in ticks of 10 ms: over a benchmark's round of 10,000
    chunks one tick is 1 µs a chunk, as much as two proxies' figures differ by."""

    ticks: dict[int, tuple[float, float]]  # pid -> user and system seconds
    threads: dict[int, dict[int, int]]  # pid -> tid -> nanoseconds on a CPU

    @classmethod
    def of(cls, pid: int) -> CpuMark:
        ticks, threads = {}, {}
        for each in tree(pid):
            with suppress(OSError, RuntimeError):
                ticks[each] = cpu_split_s(each)
                threads[each] = _on_cpu_ns(each) if SCHEDSTAT else {}
        return cls(ticks, threads)

    def since(self, before: CpuMark) -> tuple[float, float]:
        """The CPU seconds used from ``before`` to this mark, and the kernel's part (in ticks). Each process counts by
        its threads' nanoseconds, unless its ticks say more by over the ticks' rounding: a thread that ended meanwhile
        took its time out of schedstat, not out of ``utime`` and ``stime``."""
        used = system = 0.0
        for pid, (user_s, system_s) in self.ticks.items():
            user_then, system_then = before.ticks.get(pid, (0.0, 0.0))
            ticked = user_s - user_then + system_s - system_then
            system += system_s - system_then
            now, then = self.threads.get(pid, {}), before.threads.get(pid, {})
            precise = sum(ns - then.get(tid, 0) for tid, ns in now.items()) / 1e9
            used += ticked if not now or ticked - precise > TICKS_ROUNDING_S else precise
        return used, system


def _on_cpu_ns(pid: int) -> dict[int, int]:
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            threads[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return threads


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """Resident memory of the whole tree, and of its largest process."""
    sizes = []
    for each in tree(pid):
        with suppress(OSError, RuntimeError, StopIteration):
            sizes.append(rss_mb(each))
    return sum(sizes), max(sizes, default=0.0)
