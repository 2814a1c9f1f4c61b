"""Real Ray Serve on 127.0.0.1: its own venv, one head node, the streaming app of ``simulate.ray.app`` deployed on it.

Ray is never a dependency of spotdrain: ``install()`` puts PyPI's ``ray[serve]`` into a venv of its own beside
vLLM's, outside the repository, and ``available()`` says why it cannot be used where it cannot (the tests then skip
with that reason). What the install needs, learned here: Ray 2.49.0 (what deploy/kuberay runs) with today's
releases of its dependencies serves, except protobuf 7, which ``serve.run`` fails on: it is held below 7. pyarrow
(of Ray's ``llm`` extra) is what Ray Serve LLM's config models need to import; the rest of that extra, vLLM above all,
is GPU-sized and left out, so ``ray.serve.llm`` itself (which imports vLLM) does not import here.

One head node with 2 CPUs, no dashboard: the metrics agent (part of the per-node dashboard agent) runs all the
same. ``RAY_metrics_report_interval_ms`` is set in the environment of ``ray start`` as the Ray worker's container
sets it, so every process of the node (raylet, agent, Serve's replicas and proxy) exports at that pace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from simulate.venvs import Steps, Venv, python_of

VERSION = "2.49.0"
MODEL_NAME = "tiny"
APP_NAME = "llm"
STEP_S = 0.05  # one engine step of the app: a token for each running request (20 tokens/s a stream)
REQUIREMENTS = (f"ray[serve]=={VERSION}", "protobuf<7", "pyarrow>=9.0.0")
# Where Ray 2.49.0 defines LLMConfig and LLMServingArgs, which ray.serve.llm re-exports as subclasses of its own.
LLM_MODELS = "ray.llm._internal.serve.configs.server_models"
REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900.0
START_TIMEOUT_S = 120.0
# What a Ray worker's container sets for the sidecar (docs/sidecar.md): Ray's exporter takes no less than 1000.
REPORT_INTERVAL_MS = 1000


VENV = Venv(
    f"ray-{VERSION}",
    f"ray[serve] {VERSION}",
    "\n".join(REQUIREMENTS) + "\n",
    "python -m simulate.ray install installs it",
)


venv_dir = VENV.path
available = VENV.available  # None when it is installed and usable here, else why not


def install(root: Path | None = None) -> str | None:
    """Install Ray into its venv unless it is there: None once usable, else the reason (kept for ``available``)."""

    def steps(python: Path) -> Steps:
        return [
            ("pip install ray[serve]", [python, "-m", "pip", "install", "--quiet", *REQUIREMENTS]),
            ("importing Ray Serve", [python, "-c", f"import ray.serve, starlette, {LLM_MODELS}"]),
        ]

    return VENV.install(steps, INSTALL_TIMEOUT_S, root)


@dataclass
class RayNode:
    """One Ray head node (``ray start --head --block``) and the streaming app, served on ``http_port`` by Serve's proxy;
    the node's metrics agent serves every process's series on ``metrics_port``."""

    gcs_port: int
    http_port: int
    metrics_port: int
    log_path: Path
    report_interval_ms: int = REPORT_INTERVAL_MS
    process: subprocess.Popen[bytes] | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": str(REPO),  # Ray's workers import simulate.ray.app from here
            "RAY_metrics_report_interval_ms": str(self.report_interval_ms),
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def _run(self, *args: str, timeout_s: float = START_TIMEOUT_S, check: bool = True) -> bool:
        with self.log_path.open("ab") as log:
            done = subprocess.run(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env(), timeout=timeout_s
            )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:3])} failed (exit {done.returncode}): {self.log_tail()}")
        return done.returncode == 0

    def start(self) -> None:
        """Start the head node as a Ray container runs its node (``ray start --block``, the process the kubelet
        signals) and deploy the app; returns once the replica's series are on the metrics page."""
        ray = str(python_of(venv_dir()).parent / "ray")
        address = f"127.0.0.1:{self.gcs_port}"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *(ray, "start", "--head", "--block", "--num-cpus=2", "--include-dashboard=false"),
                    *("--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}"),
                    f"--metrics-export-port={self.metrics_port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
            )
        give_up = time.monotonic() + START_TIMEOUT_S
        while not self._run(ray, "status", f"--address={address}", timeout_s=30, check=False):
            if self.process.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"ray start exited or never served: {self.log_tail()}")
            time.sleep(0.5)
        self._run(
            str(python_of(venv_dir())),
            "-m",
            "simulate.ray.app",
            "--address",
            address,
            "--http-port",
            str(self.http_port),
        )
        self._wait_exported("ray_serve_replica_processing_queries")

    def terminate(self, within_s: float = 30.0) -> int:
        """What the kubelet does to the Ray container after its preStop: SIGTERM to ``ray start --block``; returns
        its exit status once it has exited."""
        assert self.process is not None, "the node was never started"
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=within_s)

    def _wait_exported(self, name: str) -> None:
        """Return once the metrics agent's page has ``name``: the replica's first export comes up to 1.5 s after
        Serve calls the app ready."""
        give_up = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < give_up:
            try:
                with urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=2) as response:
                    if f"\n{name}{{" in response.read().decode(errors="replace"):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{name} not on {self.metrics_url}/metrics within {START_TIMEOUT_S} s: {self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the node, then ``ray stop --force``: every Ray process of this machine's sessions left, as the
        node's own CLI stops them."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.terminate()
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._run(str(python_of(venv_dir()).parent / "ray"), "stop", "--force", timeout_s=60)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "no log"
        return "\n".join(text.strip().splitlines()[-lines:])
