"""The preStop script under each shell, with an empty PATH: how soon it returns once ``drained`` is written
(target: under 0.2 s) and how much CPU it uses while it waits (target: under 1 % of a core)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.common import Result, cpu_s, report
from sidecar.handshake import DrainDir

SHELLS = {"dash": ["dash"], "busybox_ash": ["busybox", "ash"], "bash": ["bash"]}
WAKE_TARGET_S = 0.2
CPU_TARGET_PERCENT = 1.0
WAIT_S = 3.0


def _measure(name: str, shell: list[str], directory: Path) -> list[Result]:
    drain_dir = DrainDir(directory)
    drain_dir.prepare(limit_s=60)
    hook = subprocess.Popen([*shell, str(drain_dir.prestop)], env={"PATH": ""})
    while not drain_dir.drain_requested():
        time.sleep(0.005)
    time.sleep(0.1)  # past the shell's start
    spent = cpu_s(hook.pid)
    time.sleep(WAIT_S)
    percent = (cpu_s(hook.pid) - spent) / WAIT_S * 100
    drain_dir.mark_drained()
    released = time.monotonic()
    hook.wait(timeout=5)
    wake_s = time.monotonic() - released
    return [
        Result.below(f"prestop_wake_{name}", wake_s, "s", WAKE_TARGET_S, "drained written to the hook returned"),
        Result.below(f"prestop_wait_cpu_{name}", percent, "%", CPU_TARGET_PERCENT, f"over {WAIT_S:g} s of waiting"),
    ]


def measure() -> list[Result]:
    results: list[Result] = []
    for name, argv in SHELLS.items():
        found = shutil.which(argv[0])
        if found is None:
            why = f"{argv[0]} is not installed here"
            results.append(Result.skip(f"prestop_wake_{name}", "s", WAKE_TARGET_S, why))
            results.append(Result.skip(f"prestop_wait_cpu_{name}", "%", CPU_TARGET_PERCENT, why))
            continue
        with tempfile.TemporaryDirectory() as directory:
            results += _measure(name, [found, *argv[1:]], Path(directory))
    return results


if __name__ == "__main__":
    report(measure())
