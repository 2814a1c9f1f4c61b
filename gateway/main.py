"""``spotdrain gateway``: build the pieces, serve the API and /metrics, check backends, until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import structlog

from gateway.backends import Pool, health_checker
from gateway.endpoints import endpoint_follower, migrator
from gateway.metrics import GatewayMetrics
from gateway.proxy import api, refused
from gateway.server import Server
from gateway.server import serve as serve_api
from gateway.settings import GatewaySettings, from_arguments
from gateway.spill import Turn
from gateway.stalls import PROBE_TIMEOUT_S, STALL_CHECK_S, stall_watcher
from gateway.streaming import Gateway
from gateway.watch import WatchTimeouts
from gateway.workers import WORKER_ENV, follow_parent, supervise
from spotdrain.kube_rest import InCluster
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import probe_app, serve
from spotdrain.settings import log_effective
from spotdrain.tasks import Role, Supervisor, on_signals

log = structlog.get_logger()


async def api_server(
    gateway: Gateway, *, after: asyncio.Event, ready_flag: asyncio.Event | None, turn: Turn | None = None
) -> None:
    """Serves the OpenAI API once /metrics listens (so a ready gateway is always observable); until cancelled.
    A worker's ``turn``: it accepts on its parent's socket, in turn with the others."""
    await after.wait()
    settings = gateway.settings
    server = Server(
        api(gateway),
        refused=refused(gateway),
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.timeouts.read_s,
    )
    await serve_api(server, host=settings.host, port=settings.port, ready_flag=ready_flag, turn=turn)


async def run(settings: GatewaySettings, *, ready_flag: asyncio.Event | None = None, worker: int | None = None) -> int:
    """Run the gateway until SIGTERM or SIGINT; returns the exit code. A ``worker`` (its index) shares the API port
    with the others, and its parent serves /metrics for all (gateway.workers)."""
    log_effective("gateway", settings)
    registry = CollectorRegistry()
    metrics = GatewayMetrics.create(registry)
    pool = Pool(settings.backends, metrics, ready_urls=settings.ready_urls)
    stop = asyncio.Event()
    on_signals(lambda sig: stop.set(), signal.SIGTERM, signal.SIGINT)
    # No connection limit: every open stream holds one backend connection for as long as it runs.
    connector = aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        gateway = Gateway(settings=settings, pool=pool, session=session, metrics=metrics)

        async def ready() -> tuple[bool, str]:
            return pool.any_ready(), f"{sum(b.ready for b in pool.backends)} backends ready"

        metrics_listening = asyncio.Event()
        roles: list[Role] = []
        turn = None if worker is None else Turn.from_environment(worker, spill_at=settings.spill_at)
        if turn is not None:
            metrics_listening.set()
        else:
            probes = probe_app(registry, ready=ready)
            server = serve(
                probes, host=settings.host, port=settings.metrics_port, ready_flag=metrics_listening, name="metrics"
            )
            roles.append(("metrics_server", server))
        roles += [
            ("api_server", api_server(gateway, after=metrics_listening, ready_flag=ready_flag, turn=turn)),
            (
                "health_checker",
                health_checker(
                    pool,
                    interval_s=settings.timeouts.health_interval_s,
                    timeout_s=settings.timeouts.connect_s,
                ),
            ),
        ]
        probe_timeout_s = min(settings.timeouts.connect_s, PROBE_TIMEOUT_S)
        roles.append(("stall_watcher", stall_watcher(pool, interval_s=STALL_CHECK_S, probe_timeout_s=probe_timeout_s)))
        if settings.service is not None:
            roles.append(("endpoint_follower", _follower(session, pool, settings)))
            interval = settings.timeouts.health_interval_s
            roles.append(("migrator", migrator(pool, margin_s=settings.migration.margin_s, interval_s=interval)))
        ok = await Supervisor(stop).run(roles)
    log.info("gateway.stopped")
    return 0 if ok else 1


def _follower(session: aiohttp.ClientSession, pool: Pool, settings: GatewaySettings) -> Coroutine[Any, Any, None]:
    service = settings.service
    assert service is not None
    return endpoint_follower(
        session,
        InCluster.from_environment(service.serviceaccount_dir),
        pool,
        namespace=service.namespace,
        service=service.name,
        port=service.port,
        timeouts=WatchTimeouts(
            request_s=settings.timeouts.connect_s,
            watch_s=math.ceil(service.watch_timeout_s),
            silence_s=service.watch_silence_s,
        ),
    )


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (the ``gateway`` extra, and the gateway image), else asyncio's own.

    Measured with bench/gateway_peers.py: stock asyncio reads each socket into a fresh 256 KiB bytes object, above
    glibc's mmap threshold, so every chunk relayed costs an mmap and a munmap besides its read; libuv reads into one
    preallocated buffer, and its loop costs less per callback.
    """
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(args: argparse.Namespace) -> int:
    settings = from_arguments(args)
    worker = None if (index := os.environ.get(WORKER_ENV)) is None else int(index)
    if worker is None and settings.workers > 1:
        return asyncio.run(supervise(settings))
    if worker is not None:
        follow_parent()
        structlog.contextvars.bind_contextvars(worker=worker)
    factory = loop_factory()
    log.info("gateway.event_loop", loop="uvloop" if factory is not None else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run(settings, worker=worker))
