from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import pkgutil
import shutil
import signal
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import structlog
from aiohttp import web

from sidecar.engines import sum_samples
from simulate.fakes.engine import EngineConfig, serve_engine
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port
from spotdrain.metrics import CollectorRegistry
from tests import control_plane as plane
from tests.real_kube import RealKube

# Either Kubernetes API a test can run against: the fake, or the real API server behind the same surface.
Kube = FakeKube | RealKube


@pytest.fixture(autouse=True)
def structlog_defaults() -> Iterator[None]:
    """Every test starts from structlog's defaults, which ``capture_logs`` sees through: a benchmark module imported
    at collection (logs at warning and up) or a command run in-process configures it for the whole process."""
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


@asynccontextmanager
async def running_engine(config: EngineConfig) -> AsyncIterator[int]:
    """A fake vLLM on a free port, served in this loop until the block ends."""
    port = free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_engine(config, host="127.0.0.1", port=port, stop=stop))
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(200):
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health"):
                        break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.01)
        yield port
    finally:
        stop.set()
        await task


@asynccontextmanager
async def serving_app(app: web.Application, *, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """Serve ``app`` on 127.0.0.1 (over TLS where ``tls`` is given) while the block runs; yields its port."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def scrape(url: str, name: str) -> float | None:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return sum_samples(await response.text(), name)


# The packages whose programs serve /metrics; one not in this checkout (yet) is passed over.
PROGRAMS = ("agent", "sidecar", "gateway", "webhook", "check")


def _takes_a_registry(function: object) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return any("CollectorRegistry" in str(parameter.annotation) for parameter in parameters)


def metric_sets() -> dict[str, type]:
    """Every class of the programs that puts series in a registry it is given (``create(registry)`` or
    ``Class(registry)``), by its dotted name: found by walking the packages, so a new program's are found too."""
    found: dict[str, type] = {}
    for package in PROGRAMS:
        try:
            root = importlib.import_module(package)
        except ModuleNotFoundError:
            continue
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if not inspect.isclass(value) or value.__module__ != module.__name__:
                    continue
                if _takes_a_registry(getattr(value, "create", None)) or _takes_a_registry(value.__init__):
                    found[f"{module.__name__}.{name}"] = value
    return found


def every_series() -> CollectorRegistry:
    """A registry holding every series the programs export, as they are at start."""
    registry = CollectorRegistry()
    for metrics in metric_sets().values():
        create = getattr(metrics, "create", None)
        if _takes_a_registry(create):
            create(registry)  # type: ignore[misc]
        else:
            metrics(registry)
    return registry


def ask_drain(drain_dir: Path) -> None:
    """Ask the sidecar for a drain as the engine's preStop script does, without its wait: create ``drain``, then
    write a byte into the FIFO ``ask`` (which the sidecar holds open: the open cannot block)."""
    (drain_dir / "drain").touch()
    descriptor = os.open(drain_dir / "ask", os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(descriptor, b"\n")
    finally:
        os.close(descriptor)


async def until(check: Callable[[], bool], *, timeout_s: float = 15) -> None:
    """Return once ``check()`` holds; TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[plane.ControlPlane]:
    """The real etcd, kube-apiserver and kube-controller-manager, started once for the session by the first test
    that needs them; skipped with the reason where the binaries are absent."""
    if (reason := plane.missing_reason()) is not None:
        pytest.skip(reason)
    directory = plane.temporary_directory()
    started = plane.start(directory)
    yield started
    started.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["fake", "real"])
async def any_kube(request: pytest.FixtureRequest) -> AsyncIterator[Kube]:
    """An empty Kubernetes API: the fake, then the real API server (each test leaves it empty again)."""
    if request.param == "fake":
        async with FakeKube() as fake:
            yield fake
    else:
        async with RealKube(request.getfixturevalue("control_plane")) as real:
            yield real


RBAC_KINDS = frozenset({"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"})


def granted_token(kube: Kube, objects: list[dict[str, object]], namespace: str, account: str) -> str | None:
    """On the real API server, a token of ``namespace/account`` that may do exactly what the RBAC among
    ``objects`` (a rendered manifest) grants it; on the fake, None (its token may do anything, and the test compares
    the calls it recorded with the grants instead)."""
    if isinstance(kube, FakeKube):
        return None
    return kube.apply_and_token([o for o in objects if o["kind"] in RBAC_KINDS], namespace, account)


@asynccontextmanager
async def node_agent(
    kube: Kube, kubeconfig: Path, *flags: str, stop_within_s: float = 15, token: str | None = None
) -> AsyncIterator[int]:
    """``spotdrain node`` in this loop, on loopback ports, with ``flags`` and ``token`` (default: one that may do
    anything); yields its notice port.

    Leaving the block sends this process SIGTERM, which the agent's handler turns into its own shutdown.
    """
    from agent.main import run
    from agent.node_settings import from_arguments
    from spotdrain.cli import build_parser

    notice_port = free_port()
    argv = ["node", "--kubeconfig", str(kube.write_kubeconfig(kubeconfig, token=token)), "--host", "127.0.0.1"]
    argv += ["--metrics-port", str(free_port()), "--notice-port", str(notice_port), "--eviction-delay", "0.1", *flags]
    ready = asyncio.Event()
    task = asyncio.create_task(run(from_arguments(build_parser().parse_args(argv)), ready_flag=ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield notice_port
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        assert await asyncio.wait_for(task, stop_within_s) == 0


# The real-engine tier (tests/engines) serves real vLLM: `make test-engines` runs it, `make test` does not.
collect_ignore = [] if os.environ.get("SPOTDRAIN_ENGINE_TIER") == "1" else ["engines"]
