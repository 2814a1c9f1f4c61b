"""Emptying a node inside a deadline: evict every pod at once, retry the ones a PodDisruptionBudget holds back
until the deadline, then wait until the evicted pods are gone.

Whatever a call fails with (an API error, a dropped connection, an answer that is not JSON, any other exception), it
is retried until the deadline: one pod's failure never abandons the others, nor the drain.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import structlog

from agent.drain.metrics import AgentMetrics
from agent.drain.nodes import NodeActions
from agent.drain.planning import MIN_GRACE_S, Eviction, plan_drain, skip_reason
from spotdrain.retry import as_api_error, retrying

log = structlog.get_logger()

PDB_BACKOFF_S = (1.0, 2.0, 3.0, 5.0)
GONE_POLL_S = (0.5, 1.0, 2.0)  # then every 2 s: most pods go quickly once drained, a few take long


@dataclass(frozen=True)
class Drained:
    evicted: dict[str, float | None]  # per namespace/name: seconds until it was gone (None: still there at the end)
    not_evicted: tuple[str, ...]  # namespace/name of pods whose eviction was refused to the end or failed


@dataclass(frozen=True)
class DrainPolicy:
    margin_s: float  # evicted pods' grace ends this long before the deadline
    agent_pod: tuple[str, str] | None  # (namespace, name) of the agent itself, never evicted
    delay_s: float = 0.0  # sidecars poll the notice endpoint: give them a moment before pods are evicted


class Drainer:
    def __init__(
        self, actions: NodeActions, *, policy: DrainPolicy, metrics: AgentMetrics, clock: Callable[[], datetime]
    ) -> None:
        self.actions = actions
        self.policy = policy
        self.metrics = metrics
        self.clock = clock

    async def drain(self, node: str, *, deadline: datetime, notice_id: str) -> Drained:
        """Evict the node's pods and wait until they are gone or the deadline passes; returns what was evicted and
        what was not."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        pods = await retrying(
            lambda: self.actions.pods_on(node), what="pods.list", forever=True, left_s=lambda: self._left_s(deadline)
        )
        plan = plan_drain(
            pods, deadline=deadline, now=self.clock(), margin_s=self.policy.margin_s, agent_pod=self.policy.agent_pod
        )
        skipped = {_key(p): r for p in pods if (r := skip_reason(p, agent_pod=self.policy.agent_pod)) is not None}
        log.info("node.draining", node=node, notice=notice_id, evict=len(plan), skipped=skipped)
        if plan:
            await asyncio.sleep(self.policy.delay_s)
        accepted = await asyncio.gather(*(self._evict(e, deadline=deadline) for e in plan))
        outcomes = {f"{e.namespace}/{e.name}": ok for e, ok in zip(plan, accepted, strict=True)}
        # A pod already terminating (evicted before a restart of the agent, or by someone else) is not evicted
        # again, but the node is not empty until it is gone: its notice is not done before then either.
        terminating = {pod for pod, reason in skipped.items() if reason == "terminating"}
        waiting = {pod for pod, ok in outcomes.items() if ok} | terminating
        took = await self._wait_gone(node, waiting, deadline=deadline, started=started)
        self.metrics.drain_duration.observe(loop.time() - started)
        drained = Drained(evicted=took, not_evicted=tuple(sorted(p for p, ok in outcomes.items() if ok is False)))
        # A drain that left pods behind says so: they go down with the instance, their replacements come late.
        report = log.warning if drained.not_evicted else log.info
        report("node.drained", node=node, notice=notice_id, evicted=took, not_evicted=list(drained.not_evicted))
        return drained

    async def _evict(self, eviction: Eviction, *, deadline: datetime) -> bool | None:
        """One pod's eviction, retried while a PodDisruptionBudget (429) or the API holds it back.

        True once evicted; None when the pod was already gone; False when given up or refused for good.
        """
        backoff = iter(PDB_BACKOFF_S)
        while True:
            grace = min(eviction.grace_s, max(MIN_GRACE_S, math.floor(self._left_s(deadline) - self.policy.margin_s)))
            try:
                await self.actions.evict(eviction.namespace, eviction.name, grace_s=grace)
            except Exception as failure:  # whatever it is, the pod is retried until the deadline
                error = as_api_error(failure)
                if error.status == 404:
                    self.metrics.evictions.labels(result="gone").inc()
                    return None
                wait_s = error.retry_after_s or next(backoff, PDB_BACKOFF_S[-1])
                if not error.transient or self._left_s(deadline) <= wait_s:
                    self.metrics.evictions.labels(result="gave_up" if error.transient else "failed").inc()
                    log.error("pod.eviction_failed", namespace=eviction.namespace, pod=eviction.name, error=str(error))
                    return False
                log.info(
                    "pod.eviction_blocked",
                    namespace=eviction.namespace,
                    pod=eviction.name,
                    error=str(error),
                    retry_in_s=wait_s,
                )
                await asyncio.sleep(wait_s)
                continue
            self.metrics.evictions.labels(result="evicted").inc()
            log.info("pod.evicted", namespace=eviction.namespace, pod=eviction.name, grace_s=grace)
            return True

    async def _wait_gone(
        self, node: str, waiting: set[str], *, deadline: datetime, started: float
    ) -> dict[str, float | None]:
        loop = asyncio.get_running_loop()
        took: dict[str, float | None] = dict.fromkeys(waiting)
        pauses = itertools.chain(GONE_POLL_S, itertools.repeat(GONE_POLL_S[-1]))
        while waiting:
            try:
                present = {_key(p) for p in await self.actions.pods_on(node)}
            except Exception as error:
                log.warning("node.pods_unreadable", node=node, error=f"{type(error).__name__}: {error}")
                present = waiting
            for gone in waiting - present:
                took[gone] = round(loop.time() - started, 3)
                log.info("pod.gone", pod=gone, after_s=took[gone])
            waiting &= present
            if not waiting or self._left_s(deadline) <= 0:
                break
            await asyncio.sleep(min(next(pauses), max(0.05, self._left_s(deadline))))
        return took

    def _left_s(self, deadline: datetime) -> float:
        return (deadline - self.clock()).total_seconds()


def _key(pod: dict[str, object]) -> str:
    meta = pod.get("metadata")
    assert isinstance(meta, dict)
    return f"{meta.get('namespace')}/{meta.get('name')}"
