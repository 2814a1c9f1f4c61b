"""``--workers N``: N gateway processes on one API port, each independent, and one /metrics that adds them up.

One event loop uses one core; the Rust routers use every core a container may have. Each worker is a whole gateway
(its own backends, health checks, EndpointSlice watch, stall and proactive moves) that accepts on the API socket the
parent made, in turn with the others (gateway.spill: the first alone until it is busy). The parent only supervises:
it serves /metrics, /live and /ready from the workers' series (prometheus_client's multiprocess mode: each worker
writes its samples to files in a directory the parent reads; a dead worker's counts stay, its gauges go), and starts a
worker again when one dies, while the others keep serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import structlog
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from gateway.settings import GatewaySettings
from gateway.spill import BOARD_ENV, LISTEN_FD_ENV, Board, listening_socket
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import probe_app, serve
from spotdrain.settings import log_effective
from spotdrain.tasks import Supervisor, on_signals

log = structlog.get_logger()

WORKER_ENV = "SPOTDRAIN_GATEWAY_WORKER"  # set, to its index, in a worker's environment by its parent
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when it is imported
RESTART_PAUSE_S = 1.0  # a worker that dies within this of its start waits this long before the next start
# Workers that have not exited this long after SIGTERM are killed: a worker gives its open streams aiohttp's
# shutdown timeout (60 s), as one gateway process does, and deploy/gateway's grace period is 70 s.
STOP_GRACE_S = 65.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def follow_parent() -> None:
    """In a worker: be sent SIGTERM when the parent dies, so no worker outlives the gateway (Linux; elsewhere a
    worker whose parent is gone already exits at once)."""
    parent = int(os.environ.get(WORKER_ENV + "_PARENT", "0"))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent and os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _metrics_dir() -> str:
    """A directory for the workers' samples: in memory where /dev/shm is writable (it is in a container whose root
    filesystem is read-only), else the temporary directory."""
    shm = Path("/dev/shm")
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="spotdrain-gateway-metrics-", dir=where)


class Workers:
    """The worker processes: started with the gateway's own command line, started again when one dies."""

    def __init__(self, count: int, argv: Sequence[str], metrics_dir: str, *, listen_fd: int, board: Path) -> None:
        self.count = count
        self.argv = list(argv)
        self.metrics_dir = metrics_dir
        self.listen_fd = listen_fd
        self.board = Board.create(board, count)
        self.running: dict[int, asyncio.subprocess.Process] = {}  # index -> process

    async def start(self, index: int) -> None:
        env = {
            **os.environ,
            WORKER_ENV: str(index),
            WORKER_ENV + "_PARENT": str(os.getpid()),
            METRICS_DIR_ENV: self.metrics_dir,
            LISTEN_FD_ENV: str(self.listen_fd),
            BOARD_ENV: str(self.board.path),
        }
        process = await asyncio.create_subprocess_exec(
            *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL, pass_fds=(self.listen_fd,)
        )
        self.running[index] = process
        log.info("gateway.worker_started", worker=index, pid=process.pid)

    async def keep(self) -> None:
        """Start every worker, and each again when it exits; runs until cancelled, then stops them all."""
        started: dict[int, float] = {}
        try:
            for index in range(self.count):
                started[index] = time.monotonic()
                await self.start(index)
            while True:
                waits = {asyncio.ensure_future(p.wait()): i for i, p in self.running.items()}
                done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for future in pending:
                    future.cancel()
                for future in done:
                    index = waits[future]
                    pid = self.running[index].pid
                    log.warning("gateway.worker_exited", worker=index, pid=pid, code=future.result())
                    mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]
                    self.board.clear(index)  # the next worker takes its connections from its next look
                    if time.monotonic() - started[index] < RESTART_PAUSE_S:
                        await asyncio.sleep(RESTART_PAUSE_S)  # a crash at start: not a tight loop of restarts
                    started[index] = time.monotonic()
                    await self.start(index)
        finally:
            await asyncio.shield(self.stop())

    async def stop(self) -> None:
        """SIGTERM to every worker; SIGKILL to those still there ``STOP_GRACE_S`` later."""
        alive = [p for p in self.running.values() if p.returncode is None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_GRACE_S):
                await asyncio.gather(*(p.wait() for p in alive))
        for process in alive:
            if process.returncode is None:
                process.kill()
                await process.wait()


def ready_check(registry: CollectorRegistry, board: Board) -> tuple[bool, str]:
    """Ready when a worker sees a ready backend and a worker takes connections on the API socket (a worker publishes
    its backends before it takes any)."""
    ready = 0.0
    for family in registry.collect():
        if family.name == "spotdrain_gateway_backends_ready":
            ready = max((sample.value for sample in family.samples), default=0.0)
    if ready <= 0:
        return False, "no backend ready"
    now = time.monotonic()
    if not any(seen.serving and not seen.stale(now) for seen in board.read()):
        return False, f"{ready:.0f} backends ready, no worker taking connections"
    return True, f"{ready:.0f} backends ready"


async def supervise(settings: GatewaySettings) -> int:
    """Run ``settings.workers`` workers and the shared /metrics until SIGTERM or SIGINT; returns the exit code."""
    log_effective("gateway", settings)
    metrics_dir = _metrics_dir()
    try:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=metrics_dir)  # type: ignore[no-untyped-call]
        try:
            sock = listening_socket(settings.host, settings.port)
        except OSError as error:
            log.error("gateway.cannot_listen", host=settings.host, port=settings.port, error=str(error))
            return 1
        with sock:
            argv = [sys.executable, "-m", "spotdrain.cli", *sys.argv[1:]]
            board = Path(metrics_dir) / "board"
            workers = Workers(settings.workers, argv, metrics_dir, listen_fd=sock.fileno(), board=board)
            stop = asyncio.Event()
            on_signals(lambda sig: stop.set(), signal.SIGTERM, signal.SIGINT)

            async def ready() -> tuple[bool, str]:
                return ready_check(registry, workers.board)

            metrics = probe_app(registry, ready=ready)
            metrics_server = serve(metrics, host=settings.host, port=settings.metrics_port, name="metrics")
            ok = await Supervisor(stop).run([("metrics_server", metrics_server), ("workers", workers.keep())])
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    log.info("gateway.stopped")
    return 0 if ok else 1
