"""The node handler: for each notice, mark the node, tell its sidecars, evict its pods, then acknowledge.

Acting is idempotent and its state lives on the node: a notice the node is already marked for is not marked
again (no second Event), and its drain resumes with the pods still there. A failure is retried until the notice's
deadline; only then is the notice handed back to its source (an SQS message comes back, later, or is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime

import structlog

from agent.drain.board import NoticeBoard
from agent.drain.eviction import Drainer
from agent.drain.metrics import AgentMetrics
from agent.drain.nodes import NodeActions, NodeIndex
from agent.drain.planning import Node, marked_for, plan_mark, plan_unmark
from agent.notices.notice import Notice
from spotdrain.clock import rfc3339
from spotdrain.retry import BACKOFF_S, ApiError

log = structlog.get_logger()

CONFLICT_RETRIES = 5


class NodeGone(Exception):
    """The node a notice is for is not in the cluster (any more)."""


@dataclass(frozen=True)
class HandlerPolicy:
    evict: bool
    heartbeat_s: float  # how often a long drain tells the notice's source it is still at work


class NodeHandler:
    def __init__(
        self,
        actions: NodeActions,
        drainer: Drainer,
        *,
        policy: HandlerPolicy,
        metrics: AgentMetrics,
        clock: Callable[[], datetime],
        board: NoticeBoard | None = None,
        local_node: str | None = None,
        index: NodeIndex | None = None,
    ) -> None:
        self.actions = actions
        self.drainer = drainer
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.board = board
        self.local_node = local_node
        self.index = index
        # Keyed by id and withdrawal: a canceled event has its notice's id, and must not wait behind its drain.
        self._active: dict[tuple[str, bool], asyncio.Future[str | None]] = {}

    async def handle(self, notice: Notice) -> None:
        """Act on one notice and acknowledge it; returns once done, or handed back to its source.

        A notice delivered again while the first delivery is still being acted on waits for that one.
        """
        key = (notice.id, notice.withdrawn)
        running = self._active.get(key)
        if running is None:
            running = self._active[key] = asyncio.ensure_future(self._act_until_deadline(notice))
            running.add_done_callback(lambda _: self._active.pop(key, None))
        else:
            log.info("notice.duplicate", notice=notice.id)
        outcome = await asyncio.shield(running)
        if notice.ack is None:
            return
        if outcome is None:
            await notice.ack.succeeded()
        else:
            await notice.ack.retry(outcome)

    async def _act_until_deadline(self, notice: Notice) -> str | None:
        """Act, retrying failures until the deadline; None when done, else why it was given up."""
        received = asyncio.get_running_loop().time()
        self.metrics.notices.labels(source=notice.source.value, kind=notice.kind.value).inc()
        log.info(
            "notice.received",
            notice=notice.id,
            kind=notice.kind.value,
            instance=notice.instance_id,
            deadline=rfc3339(notice.deadline),
            source=notice.source.value,
            withdrawn=notice.withdrawn,
        )
        backoff = iter(BACKOFF_S)
        while True:
            try:
                node = await self._node_name(notice)
                if node is None:
                    self.metrics.unknown_instances.inc()
                    log.warning("notice.unknown_instance", notice=notice.id, instance=notice.instance_id)
                    return f"instance {notice.instance_id} is not a node of this cluster"
                await self._act(notice, node, received=received)
                return None
            except (ApiError, NodeGone) as error:
                wait_s = next(backoff, BACKOFF_S[-1])
                if (notice.deadline - self.clock()).total_seconds() < wait_s:
                    log.error("notice.failed", notice=notice.id, error=str(error))
                    return str(error)
                log.warning("notice.retry", notice=notice.id, error=str(error), retry_in_s=wait_s)
                await asyncio.sleep(wait_s)

    async def _node_name(self, notice: Notice) -> str | None:
        if self.local_node is not None:
            return self.local_node
        assert self.index is not None, "queue mode needs a node index"
        return await self.index.node_for(notice.instance_id, now=asyncio.get_running_loop().time())

    async def _act(self, notice: Notice, node: str, *, received: float) -> None:
        if notice.withdrawn:
            await self._withdraw(notice, node)
            return
        if await self._mark(notice, node):
            self.metrics.notice_to_taint.observe(asyncio.get_running_loop().time() - received)
        if not notice.kind.definitive:
            return
        if self.board is not None:
            self.board.publish(node, notice)
        if self.policy.evict:
            async with self._heartbeats(notice):
                await self.drainer.drain(node, deadline=notice.deadline, notice_id=notice.id)

    async def _mark(self, notice: Notice, name: str) -> bool:
        """Taint, cordon and annotate in one guarded patch; True if this call changed the node."""
        # In queue mode the node list the instance was found in serves as the first read: in a burst that halves
        # the calls before the taint. A stale copy costs a 409 and a fresh read, never a wrong patch.
        listed = self.index.take(name) if self.index is not None else None
        for _ in range(CONFLICT_RETRIES):
            node = listed or await self._read(name)
            patch = plan_mark(node, notice)
            if patch is None and listed is not None:
                listed = None  # "already marked" is only believed from a fresh read
                continue
            listed = None
            if patch is None:
                log.info("node.already_marked", node=name, notice=notice.id)
                return False
            try:
                await self.actions.patch_node(name, patch)
            except ApiError as error:
                if error.status != 409:
                    raise
                log.info("node.conflict", node=name, notice=notice.id)
                continue
            self._log_marked(name, notice, patch)
            await self._event(node, notice, withdrawn=False)
            return True
        raise ApiError(409, f"node {name} kept changing while it was being marked")

    async def _withdraw(self, notice: Notice, name: str) -> None:
        if self.board is not None:
            self.board.withdraw(name, notice)
        for _ in range(CONFLICT_RETRIES):
            node = await self._read(name)
            patch = plan_unmark(node) if marked_for(node) == notice.id else None
            if patch is None:
                log.info("node.nothing_to_withdraw", node=name, notice=notice.id)
                return
            try:
                await self.actions.patch_node(name, patch)
            except ApiError as error:
                if error.status != 409:
                    raise
                continue
            log.info("node.unmarked", node=name, notice=notice.id, removed=sorted(patch.get("spec", {})))
            await self._event(node, notice, withdrawn=True)
            return
        raise ApiError(409, f"node {name} kept changing while it was being unmarked")

    async def _read(self, name: str) -> Node:
        node = await self.actions.get_node(name)
        if node is None:
            raise NodeGone(f"node {name} not found")
        return node

    def _log_marked(self, name: str, notice: Notice, patch: dict[str, object]) -> None:
        spec = patch.get("spec")
        assert isinstance(spec, dict)
        taint = spec["taints"][-1]
        log.info(
            "node.tainted", node=name, notice=notice.id, taint=f"{taint['key']}={taint['value']}:{taint['effect']}"
        )
        if spec.get("unschedulable"):
            log.info("node.cordoned", node=name, notice=notice.id)
        if notice.kind.definitive:
            log.info("node.annotated", node=name, notice=notice.id, termination_time=rfc3339(notice.deadline))

    async def _event(self, node: Node, notice: Notice, *, withdrawn: bool) -> None:
        # An Event is for people reading `kubectl describe node`; failing to write one must not stop the drain.
        if withdrawn:
            reason, message = "InterruptionWithdrawn", f"{notice.kind.value} notice withdrawn ({notice.source.value})"
        else:
            action = "tainted and cordoned" if notice.kind.definitive else "tainted PreferNoSchedule"
            reason = "InterruptionNotice"
            message = f"{notice.kind.value} from {notice.source.value}, deadline {rfc3339(notice.deadline)}: {action}"
        try:
            await self.actions.event(node, reason=reason, message=message, warning=not withdrawn)
        except ApiError as error:
            log.warning("node.event_failed", node=node["metadata"]["name"], error=str(error))

    @contextlib.asynccontextmanager
    async def _heartbeats(self, notice: Notice) -> AsyncIterator[None]:
        """While the block runs, tell the notice's source every ``heartbeat_s`` that the work goes on."""

        async def beat() -> None:
            assert notice.ack is not None
            while True:
                await asyncio.sleep(self.policy.heartbeat_s)
                try:
                    await notice.ack.heartbeat()
                except Exception as error:  # a missed heartbeat must not stop the drain it is about
                    log.warning("notice.heartbeat_failed", notice=notice.id, error=f"{type(error).__name__}: {error}")

        if notice.ack is None:
            yield
            return
        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
