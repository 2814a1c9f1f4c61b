"""``spotdrain node``: read notices (IMDS on a node, or SQS in queue mode) and act on them until told to stop."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol

import aiohttp
import structlog

from agent.cache.plan import CacheError
from agent.cache.run import CacheMetrics, prepare_cache, usage_reporter
from agent.drain.board import NoticeBoard
from agent.drain.eviction import Drainer, DrainPolicy
from agent.drain.handler import HandlerPolicy, NodeHandler
from agent.drain.metrics import AgentMetrics
from agent.drain.nodes import DryRunActions, KubeActions, NodeActions, NodeIndex, api_client
from agent.drain.progress import Progress, Watched
from agent.node_settings import NodeSettings, from_arguments
from agent.notices.notice import Notice
from agent.status import AgentStatus, Source
from spotdrain.clock import utcnow
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import probe_app, serve
from spotdrain.ratelimit import RateLimiter
from spotdrain.retry import ApiError
from spotdrain.settings import log_effective
from spotdrain.tasks import Role, Supervisor, on_signals

log = structlog.get_logger()


async def dispatcher(notices: AsyncIterator[Notice], handler: NodeHandler) -> None:
    """Hands each notice to the handler in a task of its own, so one long drain holds up no other notice.

    Runs as long as its source does (for ever, in practice); a handler that fails is logged and its notice handed
    back to its source (an SQS message comes back, IMDS yields it again), never allowed to stop the agent. Cancelled,
    it stops the handler's work too.
    """

    async def guarded(notice: Notice) -> None:
        try:
            await handler.handle(notice)
        except Exception:
            log.exception("notice.handler_failed", notice=notice.id)
            if notice.ack is not None:
                await notice.ack.retry("the handler failed")

    try:
        async with asyncio.TaskGroup() as group:
            async for notice in notices:
                group.create_task(guarded(notice), name=f"notice-{notice.id}")
    finally:
        await handler.close()  # the work a notice shares between its deliveries is shielded from their tasks


async def startup_check(actions: NodeActions, settings: NodeSettings, ready: asyncio.Event) -> None:
    """Reads this node (or, in queue mode, the node list) until the API answers; then the agent is ready."""
    while True:
        try:
            if settings.node_name is not None and not settings.queue_mode:
                if await actions.get_node(settings.node_name) is None:
                    raise ApiError(404, f"node {settings.node_name} not found")
            else:
                await actions.list_nodes()
        except Exception as error:  # whatever it is, the agent waits for the API rather than stop
            log.warning("startup.api_not_ready", error=str(error) if isinstance(error, ApiError) else repr(error))
            await asyncio.sleep(2)
            continue
        ready.set()
        log.info("startup.ready", node=settings.node_name, queue_mode=settings.queue_mode)
        return


async def model_cache(settings: NodeSettings, actions: NodeActions, metrics: CacheMetrics) -> None:
    """Prepares the model cache, then reports its size and free bytes while it is mounted.

    Returns at once where there is no cache. A failed preparation is logged (``cache.failed``) and leaves the startup
    taint on the node; it never stops the agent, which still has notices to act on.
    """
    with contextlib.suppress(CacheError):
        await prepare_cache(settings.cache, actions, node_name=settings.node_name, metrics=metrics)
    if not settings.cache.path.is_mount():
        return
    metrics.ready.set(1)
    await usage_reporter(metrics, settings.cache.path)


class NoticeSource(Source, Protocol):
    """IMDS or SQS: the notices, and what ``/v1/status`` says of the source."""

    def notices(self) -> AsyncIterator[Notice]: ...


def _source(settings: NodeSettings, http: aiohttp.ClientSession, registry: CollectorRegistry) -> NoticeSource:
    if settings.queue_mode:
        from agent.notices.sqs import SqsMetrics, SqsSource

        assert settings.sqs.queue_url is not None
        assert settings.sqs.region is not None
        return SqsSource(
            queue_url=settings.sqs.queue_url,
            region=settings.sqs.region,
            endpoint_url=settings.sqs.endpoint_url,
            max_receives=settings.sqs.max_receives,
            wait_time_s=settings.sqs.wait_time_s,
            max_in_flight=settings.sqs.max_in_flight,
            metrics=SqsMetrics.create(registry),
            visibility_timeout_s=max(30.0, settings.drain.heartbeat_s * 3),
        )
    from agent.notices.imds import ImdsMetrics, ImdsSource

    return ImdsSource(
        session=http,
        base_url=settings.imds.url,
        interval_s=settings.imds.interval_s,
        allow_v1=settings.imds.allow_v1,
        metrics=ImdsMetrics(registry),
    )


async def _installation_checker(settings: NodeSettings, registry: CollectorRegistry) -> Coroutine[Any, Any, None]:
    """The checks of ``spotdrain check`` on a timer, through the same API access as the agent's own calls."""
    from check.access import load
    from check.export import CheckMetrics, installation_checker
    from check.main import inspect
    from check.reading import Scope

    access = await load(settings.kube.kubeconfig)
    metrics = CheckMetrics.create(registry)
    return installation_checker(
        lambda: inspect(access, Scope(), timeout_s=settings.kube.timeout_s),
        metrics,
        interval_s=settings.check_interval_s,
    )


async def run(
    settings: NodeSettings, *, ready_flag: asyncio.Event | None = None, stop: asyncio.Event | None = None
) -> int:
    """Run the node agent until SIGTERM (or, when given, until ``stop`` is set); returns the exit code."""
    log_effective("node", settings)
    registry = CollectorRegistry()
    metrics = AgentMetrics.create(registry)
    if stop is None:
        stop = asyncio.Event()
        on_signals(lambda sig: stop.set(), signal.SIGTERM, signal.SIGINT)
    ready = asyncio.Event()

    async def readiness() -> tuple[bool, str]:
        return (True, "ok") if ready.is_set() else (False, "waiting for the Kubernetes API")

    async with api_client(settings.kube.kubeconfig) as api, aiohttp.ClientSession() as http:
        limiter = RateLimiter(qps=settings.kube.qps, burst=settings.kube.burst)
        kube = KubeActions(
            api,
            limiter=limiter,
            on_error=lambda error: metrics.api_errors.labels(kind=error.kind).inc(),
            timeout_s=settings.kube.timeout_s,
        )
        progress = Progress(stall_s=settings.drain.progress_timeout_s)
        actions: NodeActions = Watched(DryRunActions(kube) if settings.drain.dry_run else kube, progress)
        queue_mode = settings.queue_mode
        board = NoticeBoard(local_node=None if queue_mode else settings.node_name)
        agent_pod = (
            (settings.pod_namespace, settings.pod_name) if settings.pod_name and settings.pod_namespace else None
        )
        handler = NodeHandler(
            actions,
            Drainer(
                actions,
                policy=DrainPolicy(settings.drain.margin_s, agent_pod, delay_s=settings.drain.eviction_delay_s),
                metrics=metrics,
                clock=utcnow,
            ),
            policy=HandlerPolicy(evict=settings.drain.evict, heartbeat_s=settings.drain.heartbeat_s),
            metrics=metrics,
            clock=utcnow,
            board=board,
            local_node=None if queue_mode else settings.node_name,
            index=NodeIndex(actions) if queue_mode else None,
            progress=progress,
        )
        source = _source(settings, http, registry)
        probes = probe_app(registry, ready=readiness, live=progress.live)
        status = AgentStatus(settings, board=board, api_ready=ready, source=source)
        probes.router.add_get("/v1/status", status.answer)
        roles: list[Role] = [
            ("probe_server", serve(probes, host=settings.host, port=settings.metrics_port)),
            (
                "notice_server",
                serve(
                    board.app(), host=settings.host, port=settings.notice_port, name="notices", ready_flag=ready_flag
                ),
            ),
            ("startup_check", startup_check(actions, settings, ready)),
            ("dispatcher", dispatcher(source.notices(), handler)),
        ]
        # Only an agent that prepares the cache itself knows it: with --no-model-cache (the DaemonSet, whose init
        # container prepares it) the node's label and startup taint say whether it is ready, and no gauge here
        # pretends to.
        if not queue_mode and settings.cache.enabled:
            roles.append(("model_cache", model_cache(settings, actions, CacheMetrics.create(registry))))
        if settings.check_interval_s > 0:
            roles.append(("installation_checker", await _installation_checker(settings, registry)))
        try:
            ok = await Supervisor(stop).run(roles, one_shot={"startup_check", "model_cache"})
        finally:
            await kube.close()
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(from_arguments(args)))
