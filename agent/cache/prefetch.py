"""``spotdrain cache prefetch``: fetch the models the node's ``spotdrain.io/models`` annotation names into its cache
before any inference pod asks, label the node with each one's state, and report it as metrics.

It runs beside the node agent, in the same pod (a container of its own, so that a download's memory and its failures
never reach the program that acts on interruption notices), once the agent's init container has mounted the cache.
Each model is fetched as ``spotdrain cache fetch`` does, under the same lock: a pod whose init container asks for the
same model meanwhile waits for this download instead of making another. Once every model is ready (and, with
``--model-cache-wait-for-models``, the startup taint removed) it keeps serving its metrics until it is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from agent.cache.disks import update_node
from agent.cache.fetch.progress import Progress
from agent.cache.fetch.run import fetch
from agent.cache.fetch.settings import FetchSettings
from agent.cache.fetch.staging import published
from agent.cache.fetch.transfer import FetchError
from agent.cache.models import ModelState, Wanted, plan_model_label, wanted_models
from agent.cache.plan import READY_LABEL, CacheError, Outcome
from agent.cache.prefetch_settings import PrefetchSettings, from_arguments
from agent.drain.nodes import KubeActions, NodeActions, api_client
from spotdrain.metrics import CollectorRegistry, Counter, Gauge, zeroed
from spotdrain.probes import probe_app, serve
from spotdrain.ratelimit import RateLimiter
from spotdrain.retry import BACKOFF_S, ApiError, as_api_error, retrying
from spotdrain.settings import log_effective
from spotdrain.tasks import Supervisor, on_signals

log = structlog.get_logger()
STATES = ("pending", *(state.value for state in ModelState))
# FetchError.reason's values; "other" for any the fetch may add later.
FAILURE_REASONS = ("not_found", "denied", "checksum", "disk_full", "disk", "source", "listing", "other")


class PrefetchFailed(Exception):
    """With --once: a model failed in a way that retrying now will not mend."""


class Tally:
    """Each model's state and bytes, and the download in progress: what the metrics read when scraped."""

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self.states: dict[str, str] = {}
        self.ready_bytes: dict[str, int] = {}
        self.current: Progress | None = None
        self.clock = clock
        self.started = clock()
        self.ready_after_s = 0.0

    def count(self, state: str) -> int:
        return sum(1 for value in self.states.values() if value == state)

    def bytes_done(self) -> int:
        live = self.current.resumed_bytes + self.current.fetched_bytes if self.current is not None else 0
        return sum(self.ready_bytes.values()) + live

    def bytes_total(self) -> int:
        return sum(self.ready_bytes.values()) + (self.current.total_bytes if self.current is not None else 0)

    def rate(self) -> float:
        return self.current.rate(self.clock()) if self.current is not None else 0.0


@dataclass(frozen=True)
class PrefetchMetrics:
    tally: Tally
    failures: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry, *, clock: Callable[[], float] = time.monotonic) -> PrefetchMetrics:
        tally = Tally(clock=clock)
        models = Gauge("spotdrain_model_prefetch_models", "The node's models by state", ["state"], registry=registry)
        for state in STATES:
            models.labels(state=state).set_function(functools.partial(tally.count, state))
        gauges: dict[str, tuple[str, Callable[[], float]]] = {
            "spotdrain_model_prefetch_bytes": ("Bytes of the node's models in the cache", tally.bytes_done),
            "spotdrain_model_prefetch_total_bytes": (
                "Bytes of the node's models ready or being fetched",
                tally.bytes_total,
            ),
            "spotdrain_model_prefetch_bytes_per_second": ("Rate of the download in progress", tally.rate),
            "spotdrain_model_prefetch_seconds_to_ready": (
                "Seconds from the start until every model of the node was ready; 0 until then",
                lambda: tally.ready_after_s,
            ),
        }
        for name, (help_text, read) in gauges.items():
            Gauge(name, help_text, registry=registry).set_function(read)
        failures = Counter(
            "spotdrain_model_prefetch_failures_total",
            "Failed attempts to fetch one of the node's models, by reason",
            ["reason"],
            registry=registry,
        )
        zeroed(failures, "reason", FAILURE_REASONS)
        return cls(tally=tally, failures=failures)


class Prefetcher:
    """The node's models, fetched one after another, with the node's labels kept in step."""

    def __init__(self, settings: PrefetchSettings, actions: NodeActions, metrics: PrefetchMetrics) -> None:
        self.settings = settings
        self.actions = actions
        self.metrics = metrics
        self.tally = metrics.tally

    async def run(self) -> None:
        """Fetches every model of the node; returns once all are ready (failed ones are tried again every
        ``--retry-failed`` seconds, for as long as it takes), or at once where there is nothing to fetch."""
        node = await self._node()
        models, problems = wanted_models((node.get("metadata") or {}).get("annotations") or {})
        for problem in problems:
            log.warning("cache.prefetch_invalid", node=self.settings.node_name, problem=problem)
        self.tally.states = {model.name: "pending" for model in models}
        if not models:
            log.info("cache.prefetch_none", node=self.settings.node_name)
            return
        if ((node.get("metadata") or {}).get("labels") or {}).get(READY_LABEL) != "ready":
            # No instance-store cache: the models would land on the root volume, whose filling up stops the kubelet.
            log.warning("cache.prefetch_skipped", node=self.settings.node_name, reason=f"no {READY_LABEL}=ready label")
            return
        await self._fetch_all(models)
        self.tally.ready_after_s = self.tally.clock() - self.tally.started
        log.info("cache.prefetched", node=self.settings.node_name, models=len(models), seconds=self.tally.ready_after_s)
        if self.settings.wait_for_models:
            await self._release()

    async def _fetch_all(self, models: list[Wanted]) -> None:
        left = models
        while True:
            left = [model for model in left if not await self._fetch_one(model)]
            if not left:
                return
            if self.settings.once:
                raise PrefetchFailed(f"not fetched: {', '.join(model.name for model in left)}")
            log.info("cache.prefetch_retry_later", models=[m.name for m in left], in_s=self.settings.retry_failed_s)
            await asyncio.sleep(self.settings.retry_failed_s)

    async def _fetch_one(self, model: Wanted) -> bool:
        """True once the model is ready; False after a failure that will not pass by retrying now."""
        await self._mark(model, ModelState.FETCHING)
        attempt = 0
        while True:
            try:
                target = await fetch(self._fetch_settings(model), watch=self._watch)
            except FetchError as error:
                self.tally.current = None
                self._failed(error)
                if not error.transient:
                    log.error("cache.prefetch_failed", model=model.name, reason=error.reason, error=str(error))
                    await self._mark(model, ModelState.FAILED)
                    return False
                pauses = self.settings.transient_backoff_s
                delay = pauses[min(attempt, len(pauses) - 1)]
                attempt += 1
                log.warning(
                    "cache.fetch_retry", name=model.name, reason=error.reason, error=str(error), retry_in_s=delay
                )
                await asyncio.sleep(delay)
                continue
            self.tally.current = None
            record, _ = published(target)
            self.tally.ready_bytes[model.name] = sum(entry["size"] for entry in record["files"])
            await self._mark(model, ModelState.READY)
            return True

    def _watch(self, progress: Progress) -> None:
        self.tally.current = progress

    def _failed(self, error: FetchError) -> None:
        reason = error.reason if error.reason in FAILURE_REASONS else "other"
        self.metrics.failures.labels(reason=reason).inc()

    def _fetch_settings(self, model: Wanted) -> FetchSettings:
        s = self.settings
        return FetchSettings(
            source=model.source,
            name=model.name,
            cache_path=s.cache_path,
            aws_endpoint_url=s.aws_endpoint_url,
            aws_region=s.aws_region,
            concurrency=s.concurrency,
            part_size_bytes=s.part_size_bytes,
            wait=True,
            request_timeout_s=s.request_timeout_s,
            progress_interval_s=s.progress_interval_s,
            backoff_s=s.backoff_s,
        )

    async def _node(self) -> dict[str, Any]:
        """The node, once the API answers with it; waits (and says so) while it does not."""

        async def get() -> dict[str, Any]:
            node = await self.actions.get_node(self.settings.node_name)
            if node is None:
                raise ApiError(404, f"node {self.settings.node_name} not found")
            return node

        return await retrying(get, what="cache.prefetch_node", forever=True, retry_if=lambda _: True)

    async def _mark(self, model: Wanted, state: ModelState) -> None:
        """The model's label (a failure to write it is logged: the fetch matters more than its label); its state
        in the metrics either way."""
        self.tally.states[model.name] = state.value
        name = self.settings.node_name

        async def label() -> None:
            node = await self.actions.get_node(name)
            patch = plan_model_label(node or {}, model, state)
            if node is not None and patch is not None:
                await self.actions.patch_node(name, patch)

        try:
            await retrying(label, what="cache.model_label")
        except Exception as error:
            log.warning("cache.model_label_failed", node=name, model=model.name, error=str(as_api_error(error)))
            return
        log.info("cache.model_labelled", node=name, model=model.name, state=state.value)

    async def _release(self) -> None:
        """Removes the startup taint: inference pods may land now that the node has its models. Tried until done."""
        while True:
            try:
                await update_node(self.actions, self.settings.node_name, Outcome.READY)
                return
            except CacheError as error:
                log.warning("cache.release_failed", node=self.settings.node_name, error=error.output)
                await asyncio.sleep(BACKOFF_S[-1])


async def run(
    settings: PrefetchSettings, *, stop: asyncio.Event | None = None, ready_flag: asyncio.Event | None = None
) -> int:
    """Prefetch, then serve the metrics until SIGTERM (or until ``stop`` is set), or with ``--once`` exit once the
    models are ready; returns the exit code."""
    log_effective("cache prefetch", settings)
    registry = CollectorRegistry()
    async with api_client(settings.kubeconfig) as api:
        actions = KubeActions(api, limiter=RateLimiter(qps=5.0, burst=10), on_error=lambda _: None)
        prefetcher = Prefetcher(settings, actions, PrefetchMetrics.create(registry))
        try:
            if settings.once:
                return await _once(prefetcher)
            return await _serving(prefetcher, registry, stop=stop, ready_flag=ready_flag)
        finally:
            await actions.close()


async def _once(prefetcher: Prefetcher) -> int:
    try:
        await prefetcher.run()
    except PrefetchFailed as error:
        log.error("cache.prefetch_incomplete", node=prefetcher.settings.node_name, error=str(error))
        return 1
    return 0


async def _serving(
    prefetcher: Prefetcher, registry: CollectorRegistry, *, stop: asyncio.Event | None, ready_flag: asyncio.Event | None
) -> int:
    if stop is None:
        stop = asyncio.Event()
        on_signals(lambda sig: stop.set(), signal.SIGTERM, signal.SIGINT)

    async def readiness() -> tuple[bool, str]:
        return True, "ok"  # the node's labels and the metrics say how the models are

    settings = prefetcher.settings
    server = serve(
        probe_app(registry, ready=readiness), host=settings.host, port=settings.metrics_port, ready_flag=ready_flag
    )
    ok = await Supervisor(stop).run([("probe_server", server), ("prefetch", prefetcher.run())], one_shot={"prefetch"})
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(from_arguments(args)))
