"""The routers ``bench.gateway_peers`` measures the gateway against, installed from PyPI into a venv of their own.

vllm-router and sglang-router are Rust routers shipped as Python wheels: neither is a dependency of spotdrain, so
``routers()`` puts them into a venv in a cache outside the repository (``SPOTDRAIN_PEER_CACHE``, default
``~/.cache/spotdrain-peers``), once, and says for each why it cannot be run where it cannot. Each runs as its own
documented command line, routing to the benchmark's one backend, logging warnings only.

LiteLLM's proxy is not measured: ``litellm[proxy]`` pulls in some hundred packages, and at the latency it adds
(hundreds of milliseconds a chunk, measured once on this machine) one round of the benchmark would take minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"vllm-router": "0.1.17", "sglang-router": "0.3.2"}
LITELLM_SKIPPED = (
    "LiteLLM's proxy is not installed: litellm[proxy] brings some hundred packages, and at the hundreds of "
    "milliseconds a chunk it adds, its rounds alone would take most of the run"
)
INSTALL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Peer:
    name: str  # as in the table: "vllm-router 0.1.17"
    argv: list[str]  # {port} and {backend} filled in by argv_for


@dataclass(frozen=True)
class Missing:
    name: str
    reason: str


def cache_root() -> Path:
    configured = os.environ.get("SPOTDRAIN_PEER_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "spotdrain-peers"


def venv_dir() -> Path:
    return cache_root() / ("routers-" + "-".join(f"{name}{version}" for name, version in PACKAGES.items()))


def _install(venv: Path) -> str | None:
    """None once the routers are in ``venv``, else why they could not be installed."""
    stamp = venv / ".spotdrain-ready"
    if stamp.exists():
        return None
    python = venv / "bin" / "python"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", *(f"{n}=={v}" for n, v in PACKAGES.items())],
    ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"{' '.join(step[:4])} failed: {error}"
        if done.returncode != 0:
            lines = [x for x in (done.stderr or done.stdout).splitlines() if not x.startswith("WARNING")]
            return f"{' '.join(step[:4])} failed: {lines[-1] if lines else done.returncode}"
    stamp.write_text(" ".join(f"{n}=={v}" for n, v in PACKAGES.items()) + "\n")
    return None


def routers() -> list[Peer | Missing]:
    """Each Rust router ready to start, or why it cannot be."""
    venv = venv_dir()
    names = [f"{name} {version}" for name, version in PACKAGES.items()]
    if (reason := _install(venv)) is not None:
        return [Missing(name, reason) for name in names]
    python = str(venv / "bin" / "python")
    common = ["--host", "127.0.0.1", "--port", "{port}", "--worker-urls", "{backend}", "--log-level"]
    # Each exposes Prometheus metrics on a port of its own: given one, so two never collide on the default.
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", "{metrics_port}"]
    return [
        Peer(names[0], [python, "-m", "vllm_router.launch_router", *common, "warning", *metrics]),
        Peer(names[1], [python, "-m", "sglang_router.launch_router", *common, "warn", *metrics]),
    ]


def argv_for(peer: Peer, *, port: int, metrics_port: int, backend: str) -> list[str]:
    values = {"{port}": str(port), "{metrics_port}": str(metrics_port), "{backend}": backend}
    return [values.get(arg, arg) for arg in peer.argv]
