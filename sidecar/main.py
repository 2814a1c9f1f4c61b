"""``spotdrain sidecar``: build the pieces, run the roles, exit 0 once drained and told to terminate."""

from __future__ import annotations

import argparse
import asyncio
import signal

import structlog

from sidecar.draining import drainer
from sidecar.engine_client import EngineClient, engine_session
from sidecar.gate import gate_keeper
from sidecar.handshake import DrainDir
from sidecar.lifecycle import Lifecycle
from sidecar.metrics import SidecarMetrics
from sidecar.notices import notice_watcher
from sidecar.record import DrainRecord, RecordError, read_record
from sidecar.settings import SidecarSettings, from_arguments
from sidecar.state import Phase
from spotdrain.clock import rfc3339, utcnow
from spotdrain.kube_rest import InCluster
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import probe_app, serve
from spotdrain.settings import log_effective
from spotdrain.tasks import Role, Supervisor, on_signals

log = structlog.get_logger()

# How long the preStop script waits for the sidecar beyond the drain timeout, should the sidecar be gone.
PRESTOP_SLACK_S = 15.0


def resumed_drain(drain_dir: DrainDir, metrics: SidecarMetrics) -> DrainRecord | None:
    """The drain a sidecar before this one started in this pod, if any: it goes on, the pod never serves again."""
    try:
        record = read_record(drain_dir.draining)
    except RecordError as error:
        metrics.record_errors.inc()
        log.warning("drain.record_unreadable", path=str(drain_dir.draining), error=str(error))
        record = DrainRecord("resumed", started=utcnow(), deadline=None)
    if record is not None:
        deadline = None if record.deadline is None else rfc3339(record.deadline)
        log.info("drain.resumed", reason=record.reason, started=rfc3339(record.started), deadline=deadline)
    return record


async def prestop_watcher(drain_dir: DrainDir, lifecycle: Lifecycle) -> None:
    """Asks for a drain the moment the engine's preStop writes into ``<drain-dir>/ask`` (it has created ``drain``
    then); returns once a drain is asked, by it or another way. No timer: it waits on the FIFO's descriptor."""
    if lifecycle.drain_asked.is_set():
        return
    loop = asyncio.get_running_loop()

    def readable() -> None:
        if drain_dir.take_asks():
            lifecycle.ask_drain("prestop")

    loop.add_reader(drain_dir.asks, readable)
    try:
        await lifecycle.drain_asked.wait()
    finally:
        loop.remove_reader(drain_dir.asks)


async def terminator(lifecycle: Lifecycle, stop: asyncio.Event) -> None:
    """On SIGTERM, drains (holding termination) and stops the program once drained."""
    await lifecycle.terminated.wait()
    lifecycle.ask_drain("sigterm")
    await lifecycle.drained.wait()
    log.info("sidecar.exiting", reason=lifecycle.reason)
    stop.set()


async def run(settings: SidecarSettings, *, ready_flag: asyncio.Event | None = None) -> int:
    """Run the sidecar until it has drained and received SIGTERM; returns the exit code."""
    log_effective("sidecar", settings)
    registry = CollectorRegistry()
    metrics = SidecarMetrics.create(registry)
    lifecycle = Lifecycle(metrics)
    drain_dir = DrainDir(settings.drain.dir)
    # The preStop script must exist before /ready first answers 200, and a drain in progress before it, resumed.
    asked = drain_dir.prepare(limit_s=settings.drain.timeout_s + PRESTOP_SLACK_S)
    resumed = resumed_drain(drain_dir, metrics)
    if resumed is not None:
        lifecycle.ask_drain(resumed.reason, deadline=resumed.deadline, started=resumed.started)
    elif asked:
        lifecycle.ask_drain("prestop")
    stop = asyncio.Event()
    on_signals(lambda sig: lifecycle.terminated.set(), signal.SIGTERM, signal.SIGINT)

    async with engine_session() as session:
        engine = EngineClient(session, settings.engine, metrics, answered_s=settings.drain.zero_confirm_s)

        async def ready() -> tuple[bool, str]:
            if lifecycle.phase is not Phase.SERVING:
                return False, lifecycle.phase.value
            return await engine.healthy()

        app = probe_app(registry, ready=ready)
        roles: list[Role] = [
            ("probe_server", serve(app, host=settings.host, port=settings.port, ready_flag=ready_flag)),
            ("prestop_watcher", prestop_watcher(drain_dir, lifecycle)),
            ("drainer", drainer(lifecycle, engine, drain_dir, settings.drain, metrics)),
            ("terminator", terminator(lifecycle, stop)),
        ]
        if settings.drain.notice_url:
            roles.append(
                (
                    "notice_watcher",
                    notice_watcher(
                        session,
                        settings.drain.notice_url,
                        lifecycle,
                        metrics,
                        interval_s=settings.drain.poll_interval_s,
                        wait_s=settings.drain.notice_wait_s,
                    ),
                )
            )
        if settings.gate.enabled:
            assert settings.gate.pod_namespace is not None
            assert settings.gate.pod_name is not None
            roles.append(
                (
                    "gate_keeper",
                    gate_keeper(
                        session,
                        InCluster.from_environment(settings.gate.serviceaccount_dir),
                        namespace=settings.gate.pod_namespace,
                        pod=settings.gate.pod_name,
                        lifecycle=lifecycle,
                        metrics=metrics,
                    ),
                )
            )
        one_shot = {"prestop_watcher", "drainer", "notice_watcher", "gate_keeper"}
        ok = await Supervisor(stop).run(roles, one_shot=one_shot)
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(from_arguments(args)))
