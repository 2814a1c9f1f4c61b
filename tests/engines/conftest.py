"""Real vLLM servers for the real-engine tier: started once per session, revived after a test kills one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simulate.fakes.processes import free_port
from simulate.ray.server import RayNode
from simulate.ray.server import available as ray_available
from simulate.vllm.server import VllmServer, available, start_servers, thinking_model, tiny_model
from tests.engines.engine_record import recording

SERVERS = 3  # enough to kill one and still continue on another, with a third for tests that need two alive
TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
SCALE_OUT = "--enable-scale-out"  # /v1/chat/completions/derender: vLLM's own replay of its parsers
THINKING_ARGS = ("--reasoning-parser", "deepseek_r1", *TOOLS, SCALE_OUT)


def built(model: Callable[[], Path]) -> Path:
    """A model for real vLLM, built (or taken from its cache); the test skips with the reason where it cannot be."""
    reason = available()
    if reason is not None:
        pytest.skip(reason)
    try:
        return model()
    except (OSError, RuntimeError) as error:
        pytest.skip(str(error))


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    return built(tiny_model)


@pytest.fixture(scope="session")
def thinking_vllm_model() -> Path:
    """The tiny model trained to reason and call tools (``simulate.vllm.thinking_model``), built once."""
    return built(thinking_model)


@pytest.fixture(scope="session")
def thinking_vllm(thinking_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The thinking model on one real vLLM with ``THINKING_ARGS``, for the modules that only ask it questions (none
    stops it, kills it or needs it fresh): started once, where each such module's own cost a start of some 27 s."""
    server = serving(thinking_vllm_model, tmp_path_factory.mktemp("thinking"), THINKING_ARGS)
    try:
        yield server
    finally:
        server.stop()


def serving(model: Path, log_dir: Path, args: tuple[str, ...]) -> VllmServer:
    server = VllmServer(port=free_port(), model=model, log_path=log_dir / "vllm.log", extra_args=args)
    server.start()
    try:
        server.wait_ready()
    except BaseException:
        server.kill()
        raise
    return server


@pytest.fixture(scope="session")
def vllm_pool(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    log_dir = tmp_path_factory.mktemp("vllm")
    middleware, env = recording(log_dir)  # what each is asked and sends, for the gateway's tests to judge by
    ports = [free_port() for _ in range(SERVERS)]
    servers = start_servers(ports, model=vllm_model, log_dir=log_dir, extra_args=middleware, env=env)
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def vllm_servers(vllm_pool: list[VllmServer]) -> list[VllmServer]:
    """Every server of the pool running: one a previous test killed or stopped is started again first."""
    dead = [server for server in vllm_pool if server.process is None or server.process.poll() is not None]
    for server in dead:
        server.start()
    for server in dead:
        server.wait_ready()
    return vllm_pool


@pytest.fixture(scope="module")
def ray_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNode]:
    """A real Ray head node serving the streaming app, fresh for each module (one whose first test needs a node
    that never served, and none left running beside the vLLM tests after); stopped by SIGTERM to its ``ray start
    --block``, as the kubelet stops a Ray container, unless a test did, then ``ray stop --force``."""
    reason = ray_available()
    if reason is not None:
        pytest.skip(reason)
    node = RayNode(
        gcs_port=free_port(),
        http_port=free_port(),
        metrics_port=free_port(),
        log_path=tmp_path_factory.mktemp("ray") / "ray.log",
    )
    try:
        node.start()
        yield node
    finally:
        node.stop()
