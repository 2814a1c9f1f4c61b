"""The venvs of the real engines (vLLM, Ray), each in a cache outside the repository: ready once the stamp inside
says what was installed, else the reason it could not be, kept beside it for the tests and ``simulate`` to skip
with. Neither engine is ever a dependency of spotdrain."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

Steps = list[tuple[str, list[str | Path]]]  # what each step does, said in a failure's reason, and its command line


def cache_root() -> Path:
    configured = os.environ.get("SPOTDRAIN_ENGINE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "spotdrain-engines"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def run(args: Sequence[str | Path], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if not line.startswith("WARNING: Location")]
    return lines[-1][:300] if lines else "no output"


@dataclass(frozen=True)
class Venv:
    """``name`` in the cache, holding ``what``; ``stamp`` is what a ready venv records (a venv made before a
    requirement was added is installed again); ``hint`` says how to install it."""

    name: str
    what: str
    stamp: str
    hint: str

    def path(self, root: Path | None = None) -> Path:
        return (root or cache_root()) / self.name

    def available(self, root: Path | None = None) -> str | None:
        """None when the venv is installed and usable here, else why not."""
        root = root or cache_root()
        venv = self.path(root)
        stamp = venv / ".spotdrain-ready"
        if stamp.exists() and stamp.read_text() == self.stamp and python_of(venv).exists():
            return None
        if self._reason_file(root).exists():
            return self._reason_file(root).read_text().strip()
        return f"{self.what} is not installed in {venv} ({self.hint})"

    def install(self, steps: Callable[[Path], Steps], timeout_s: float, root: Path | None = None) -> str | None:
        """Run ``steps(python)`` into the venv unless it is ready: None once usable, else the reason (kept for
        ``available``)."""
        root = root or cache_root()
        venv = self.path(root)
        if self.available(root) is None:
            return None
        root.mkdir(parents=True, exist_ok=True)
        planned: Steps = []
        if not python_of(venv).exists():
            planned.append(("creating the venv", [sys.executable, "-m", "venv", venv]))
        for what, args in planned + steps(python_of(venv)):
            try:
                done = run(args, timeout_s=timeout_s)
            except (OSError, subprocess.TimeoutExpired) as error:
                return self._give_up(root, f"{what} failed: {error}")
            if done.returncode != 0:
                return self._give_up(
                    root, f"{what} failed (exit {done.returncode}): {last_line(done.stderr or done.stdout)}"
                )
        (venv / ".spotdrain-ready").write_text(self.stamp)
        self._reason_file(root).unlink(missing_ok=True)
        return None

    def _reason_file(self, root: Path) -> Path:
        return root / f"{self.name}.skipped"

    def _give_up(self, root: Path, reason: str) -> str:
        self._reason_file(root).write_text(reason + "\n")
        return reason


def install_command(argv: list[str], engine: str, install: Callable[[], str | None], ready: Callable[[], str]) -> int:
    """``python -m simulate.<engine> install``: put the real engine in place and say what is ready, or say why it
    cannot be. Exits 0 either way: a machine without it runs its tests as skipped, with this reason."""
    if argv != ["install"]:
        print(f"usage: python -m simulate.{engine.lower()} install", file=sys.stderr)
        return 2
    reason = install()
    if reason is None:
        try:
            print(f"real {engine} ready: {ready()}")
            return 0
        except (OSError, RuntimeError) as error:
            reason = str(error)
    print(f"real {engine} skipped: {reason}")
    return 0
