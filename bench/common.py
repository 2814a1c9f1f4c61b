"""One result format for every benchmark: name, value, unit, target and whether it was met."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Result:
    name: str
    value: float
    unit: str
    target: float
    passed: bool
    detail: str = ""

    @classmethod
    def below(cls, name: str, value: float, unit: str, target: float, detail: str = "") -> Result:
        return cls(name, round(value, 4), unit, target, value < target, detail)


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
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
