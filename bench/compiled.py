"""The gateway as its image ships it: the package built with ``SPOTDRAIN_COMPILE=1`` (setup.py: the relay path
compiled by mypyc), for the benchmarks and the compiled tests to run with that directory first on ``PYTHONPATH``.

``built()`` copies the package's sources to a scratch directory (the build writes its C files beside them), builds
them with this Python's pip, mypy and C compiler into ``compiled-<key>`` in the benchmarks' cache
(``SPOTDRAIN_PEER_CACHE``, default ``~/.cache/spotdrain-peers``), keyed by every source file, this Python and mypy,
so a tree is built once; where it cannot be built (no C compiler, no mypy), it says why.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.peer_routers import cache_root

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spotdrain", "agent", "check", "sidecar", "inject", "webhook", "simulate", "gateway")
FILES = ("setup.py", "pyproject.toml", "README.md")
BUILD_TIMEOUT_S = 900.0
READY = ".spotdrain-ready"
COMPILE_ENV = "SPOTDRAIN_COMPILE"  # setup.py's


@dataclass(frozen=True)
class Unbuilt:
    reason: str


def _sources() -> list[Path]:
    found = [ROOT / name for name in FILES]
    for package in PACKAGES:
        found += sorted(p for p in (ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return found


def key() -> str:
    """What the build is made from: every source file, this Python, mypy's version."""
    digest = hashlib.sha256(sys.version.encode())
    try:
        from mypy.version import __version__ as mypy_version
    except ImportError:
        mypy_version = "none"
    digest.update(mypy_version.encode())
    for path in _sources():
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def built() -> Path | Unbuilt:
    """The directory the compiled package is in, built now where it is not yet; or why it cannot be."""
    made_from = key()
    target = cache_root() / f"compiled-{made_from}"
    if (target / READY).exists():
        return target
    with tempfile.TemporaryDirectory(prefix="spotdrain-compile-") as name:
        scratch = Path(name)
        for path in _sources():
            copy = scratch / "src" / path.relative_to(ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy)
        out = scratch / "out"
        step = [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation", "--no-deps"]
        step += ["--target", str(out), str(scratch / "src")]
        try:
            done = subprocess.run(
                step,
                capture_output=True,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
                env={**os.environ, COMPILE_ENV: "1"},
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return Unbuilt(f"the compiled build failed: {error}")
        if done.returncode != 0:
            lines = [x.strip() for x in (done.stderr or done.stdout).splitlines() if x.strip()]
            return Unbuilt(f"the compiled build failed: {lines[-1] if lines else done.returncode}")
        if not list((out / "gateway").glob("relay.*.so")):
            return Unbuilt(f"the build left gateway/relay.py uncompiled (is {COMPILE_ENV} read by setup.py?)")
        (out / READY).write_text(made_from + "\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(out, target)
    return target
