"""``pip install spotdrain`` without an extra: the sidecar and the gateway run, and every other command says in one
line which extra it needs instead of ending in a traceback.

The base install is played in this environment by hiding every module that only an extra brings: the distributions
the extras require, with theirs, less what the base dependencies require themselves (read from the installed
metadata, so a new dependency is hidden too). A ``sitecustomize`` on ``PYTHONPATH`` hides them in every Python
process the command starts (the gateway's workers are processes of their own)."""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simulate.fakes.processes import free_port, start, stop, wait_http
from tests.distributions import closure, normalized, requirements

EXTRAS = ("node", "inject", "webhook", "gateway")
HIDE = """
import sys
HIDDEN = frozenset({hidden!r})
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hidden())
"""


def hidden_modules() -> set[str]:
    base = closure(r.name for r in requirements(""))
    extras = closure(r.name for extra in EXTRAS for r in requirements(extra)) - base
    modules: dict[str, set[str]] = {}
    for module, distributions in metadata.packages_distributions().items():
        for distribution in distributions:
            modules.setdefault(normalized(distribution), set()).add(module)
    return {module for distribution in extras for module in modules.get(distribution, ())}


@pytest.fixture(scope="module")
def base_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    hidden = hidden_modules()
    assert {"kubernetes_asyncio", "awscrt", "yaml", "cryptography", "uvloop", "orjson"} <= hidden
    assert not hidden & {"aiohttp", "structlog", "prometheus_client", "multidict", "yarl"}
    site = tmp_path_factory.mktemp("base-install")
    (site / "sitecustomize.py").write_text(HIDE.format(hidden=sorted(hidden)))
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(site), root))}


def spotdrain(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "spotdrain.cli", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_the_hiding_is_what_a_base_install_lacks(base_env: dict[str, str]) -> None:
    done = spotdrain(base_env, "--help")
    assert done.returncode == 0, done.stderr
    probe = "import importlib.util as u; print(u.find_spec('aiohttp') is not None); import yaml"
    hidden = subprocess.run([sys.executable, "-c", probe], env=base_env, capture_output=True, text=True, check=False)
    assert hidden.stdout == "True\n"
    assert "No module named 'yaml'" in hidden.stderr


@pytest.mark.parametrize(
    "command", ["sidecar", "node", "gateway", "cache", "cache fetch", "inject", "webhook", "check", "simulate"]
)
def test_every_commands_help_works_on_the_base_install(base_env: dict[str, str], command: str) -> None:
    done = spotdrain(base_env, *command.split(), "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: spotdrain {command}")


@pytest.mark.parametrize(
    ("args", "extras"),
    [
        (["node", "--node-name", "gpu-1"], "node"),
        (["cache", "--model-cache-path", "{tmp}/cache"], "node"),
        (["cache", "fetch", "s3://bucket/models/m/", "--name", "m", "--model-cache-path", "{tmp}/cache"], "node"),
        (["inject", "-f", "{tmp}/app.yaml"], "inject"),
        (["check", "--kubeconfig", "{tmp}/kubeconfig"], "node"),
        (
            [
                "webhook",
                "--self-managed-tls",
                "--namespace",
                "spotdrain",
                "--tls-cert",
                "{tmp}/c",
                "--tls-key",
                "{tmp}/k",
            ],
            "webhook",
        ),
        (["simulate"], "node,webhook"),
    ],
)
def test_a_command_without_its_extra_says_which_in_one_line(
    base_env: dict[str, str], tmp_path: Path, args: list[str], extras: str
) -> None:
    (tmp_path / "app.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec: {containers: []}\n")
    (tmp_path / "kubeconfig").write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    done = spotdrain(base_env, *(arg.format(tmp=tmp_path) for arg in args))
    assert done.returncode == 2
    command = " ".join(args[:2] if args[0] == "cache" and args[1] == "fetch" else args[:1])
    named = " and ".join(f"the {e!r} extra" for e in extras.split(","))
    pattern = (
        rf"spotdrain {command}: error: needs {named} \(No module named '\w+'\): pip install 'spotdrain\[{extras}\]'"
    )
    assert re.fullmatch(pattern, done.stderr.splitlines()[-1]), done.stderr
    assert "Traceback" not in done.stderr


async def test_the_sidecar_serves_and_stops_on_the_base_install(base_env: dict[str, str], tmp_path: Path) -> None:
    port = free_port()
    args = ["-m", "spotdrain.cli", "sidecar", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--engine-url", f"http://127.0.0.1:{free_port()}", "--drain-dir", str(tmp_path), "--drain-timeout", "1"]
    process = await start(args, log_path=tmp_path / "sidecar.log", env=base_env)
    try:
        await wait_http(f"http://127.0.0.1:{port}/ready", status=503)  # no engine answers: not ready, but serving
        assert (tmp_path / "prestop").exists()
    finally:
        await stop(process)
    assert process.returncode == 0, (tmp_path / "sidecar.log").read_text()


async def test_the_gateway_serves_on_the_base_install(base_env: dict[str, str], tmp_path: Path) -> None:
    metrics = free_port()
    args = ["-m", "spotdrain.cli", "gateway", "--host", "127.0.0.1", "--port", str(free_port())]
    args += ["--metrics-port", str(metrics), "--backend", f"http://127.0.0.1:{free_port()}", "--workers", "1"]
    process = await start(args, log_path=tmp_path / "gateway.log", env=base_env)
    try:
        await wait_http(f"http://127.0.0.1:{metrics}/live", status=200)
    finally:
        await stop(process)
    assert "Traceback" not in (tmp_path / "gateway.log").read_text()
