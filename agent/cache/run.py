"""``spotdrain cache``: prepare the model cache once and exit. ``prepare_cache`` is the same work for the node agent.

Disks first, then the node: the label ``spotdrain.io/model-cache=ready`` and the removal of the startup taint
``spotdrain.io/model-cache-pending:NoSchedule`` come only once the cache is mounted. A node without instance-store
disks (or with the cache disabled) loses the startup taint and gets no label: there is nothing to wait for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import structlog
from kubernetes_asyncio.config import ConfigException

from agent.cache.disks import ProcessRunner, Runner, prepare_disks, select_devices, update_node
from agent.cache.plan import CacheError, Outcome, Plan, Step
from agent.cache.settings import CacheCommandSettings, CacheSettings, command_from_arguments
from agent.drain.nodes import KubeActions, NodeActions, api_client
from spotdrain.metrics import CollectorRegistry, Gauge
from spotdrain.ratelimit import RateLimiter
from spotdrain.settings import log_effective

log = structlog.get_logger()


@dataclass(frozen=True)
class CacheMetrics:
    size_bytes: Gauge
    free_bytes: Gauge
    ready: Gauge

    @classmethod
    def create(cls, registry: CollectorRegistry) -> CacheMetrics:
        return cls(
            size_bytes=Gauge(
                "spotdrain_model_cache_size_bytes", "Size of the model cache filesystem", registry=registry
            ),
            free_bytes=Gauge(
                "spotdrain_model_cache_free_bytes",
                "Bytes free for unprivileged users in the model cache",
                registry=registry,
            ),
            ready=Gauge("spotdrain_model_cache_ready", "1 once the model cache is mounted", registry=registry),
        )

    def refresh(self, path: Path) -> None:
        """Size and free bytes of the filesystem mounted at ``path`` (statvfs)."""
        usage = os.statvfs(path)
        self.size_bytes.set(usage.f_blocks * usage.f_frsize)
        self.free_bytes.set(usage.f_bavail * usage.f_frsize)


async def usage_reporter(metrics: CacheMetrics, path: Path, *, interval_s: float = 30.0) -> None:
    """Refreshes the cache's size and free bytes every ``interval_s``; runs until cancelled."""
    while True:
        try:
            metrics.refresh(path)
        except OSError as error:
            log.warning("cache.usage_unreadable", path=str(path), error=str(error))
        await asyncio.sleep(interval_s)


@dataclass(frozen=True)
class CacheResult:
    outcome: Outcome
    reason: str
    device: str | None  # the mounted block device (a disk, or /dev/md/<name>)
    path: Path
    steps: tuple[Step, ...]  # every command run; empty on a node that was ready already
    node_changed: bool


async def prepare_cache(
    settings: CacheSettings,
    actions: NodeActions | None,
    *,
    node_name: str | None,
    metrics: CacheMetrics | None,
    runner: Runner | None = None,
) -> CacheResult:
    """Bring the disks to a mounted cache, then label and untaint the node (when ``actions`` and a node are given).

    Returns once both are done. A failed step raises CacheError; the startup taint stays on the node.
    """
    try:
        plan, steps = await _prepare_disks(settings, runner or ProcessRunner())
    except CacheError as error:
        log.error("cache.failed", step=error.step, device=error.device, output=error.output)
        if metrics is not None:
            metrics.ready.set(0)
        await _mark_failed(actions, node_name)
        raise
    outcome = Outcome.READY if plan.target is not None else Outcome.ABSENT
    if metrics is not None:
        metrics.ready.set(1 if outcome is Outcome.READY else 0)
        if outcome is Outcome.READY:
            metrics.refresh(settings.path)
    changed = False
    if actions is not None and node_name:
        changed = await update_node(actions, node_name, outcome, wait_for_models=settings.wait_for_models)
    log.info(
        "cache." + outcome.value, device=plan.target, path=str(settings.path), reason=plan.reason, steps=len(steps)
    )
    return CacheResult(outcome, plan.reason, plan.target, settings.path, steps, changed)


async def _prepare_disks(settings: CacheSettings, runner: Runner) -> tuple[Plan, tuple[Step, ...]]:
    if not settings.enabled:
        return Plan((), "disabled (--no-model-cache)", None), ()
    devices = select_devices(settings)
    log.info("cache.devices", devices=devices, chosen_by="--model-cache-devices" if settings.devices else "discovery")
    prepared = await prepare_disks(devices, settings, runner)
    return prepared.plan, prepared.steps


async def _mark_failed(actions: NodeActions | None, node_name: str | None) -> None:
    """Take back a ready label an earlier boot left; the cache's own error is what gets reported."""
    if actions is None or not node_name:
        return
    try:
        await update_node(actions, node_name, Outcome.FAILED)
    except CacheError as error:
        log.warning("cache.node_not_updated", node=node_name, error=str(error))


async def run(settings: CacheCommandSettings, *, runner: Runner | None = None) -> CacheResult:
    """Prepare the cache once; with a node name, also label and untaint that node."""
    if settings.node_name is None:
        return await prepare_cache(settings.cache, None, node_name=None, metrics=None, runner=runner)
    async with api_client(settings.kubeconfig) as api:
        actions = KubeActions(api, limiter=RateLimiter(qps=5.0, burst=10), on_error=lambda _: None)
        return await prepare_cache(settings.cache, actions, node_name=settings.node_name, metrics=None, runner=runner)


def main(args: argparse.Namespace) -> int:
    settings = command_from_arguments(args)
    log_effective("cache", settings)
    try:
        asyncio.run(run(settings))
    except CacheError as error:
        print(f"spotdrain cache: error: {error}", file=sys.stderr)
        return 1
    except ConfigException as error:
        print(f"spotdrain cache: error: no Kubernetes configuration for --node-name: {error}", file=sys.stderr)
        return 1
    return 0
