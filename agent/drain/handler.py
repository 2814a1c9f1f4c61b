"""The node handler: for each notice, mark the node, tell its sidecars, evict its pods, then acknowledge.

Acting is idempotent and its state lives on the node: a notice the node is already marked for is not marked
again (no second Event), and its drain resumes with the pods still there. Each API call retries its transient errors
on a schedule of its own, bounded by the notice's deadline; whatever else fails (any exception) retries the whole
action with backoff. Only at the deadline is the notice handed back to its source (an SQS message comes back, later,
or is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import structlog

from agent.drain.board import NoticeBoard
from agent.drain.eviction import Drainer
from agent.drain.metrics import AgentMetrics
from agent.drain.node_events import NodeEvents
from agent.drain.nodes import NodeActions, NodeIndex
from agent.drain.planning import Node, instance_id_of, marked_for, plan_mark, plan_unmark, resumed
from agent.drain.progress import Progress
from agent.notices.notice import Notice
from spotdrain.clock import rfc3339
from spotdrain.retry import BACKOFF_S, ApiError, retrying

log = structlog.get_logger()
T = TypeVar("T")

CONFLICT_RETRIES = 5


class NodeGone(Exception):
    """The node a notice is for is not in the cluster (any more)."""


class NodeReplaced(NodeGone):
    """The node under the name found for the notice's instance is another instance's now."""


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
        progress: Progress | None = None,
    ) -> None:
        self.actions = actions
        self.drainer = drainer
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.board = board
        self.local_node = local_node
        self.index = index
        self.progress = progress
        self.events = NodeEvents(actions)
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

    async def close(self) -> None:
        """Stop acting on every notice in hand (the agent is stopping); returns once their work has ended."""
        running = list(self._active.values())
        for future in running:
            future.cancel()
        await asyncio.gather(*running, *self.events.cancel(), return_exceptions=True)

    async def _act_until_deadline(self, notice: Notice) -> str | None:
        """Act, retrying failures until the deadline; None when done, else why it was given up."""
        received = asyncio.get_running_loop().time()
        self.metrics.notices.labels(source=notice.source.value, kind=notice.kind.value).inc()
        log.info("notice.received", **notice.logged(), source=notice.source.value, withdrawn=notice.withdrawn)
        held = self.progress.holding(notice.id) if self.progress is not None else contextlib.nullcontext()
        with held:
            return await self._retry_until_deadline(notice, received=received)

    async def _retry_until_deadline(self, notice: Notice, *, received: float) -> str | None:
        backoff = iter(BACKOFF_S)  # for failures a call's own retries did not absorb
        while True:
            try:
                node = await self._node_name(notice)
                if node is None:
                    self.metrics.unknown_instances.inc()
                    log.warning("notice.unknown_instance", notice=notice.id, instance=notice.instance_id)
                    return f"instance {notice.instance_id} is not a node of this cluster"
                await self._act(notice, node, received=received)
                return None
            except Exception as error:  # whatever it is, the notice stays pending until its deadline
                reason = str(error) if isinstance(error, ApiError | NodeGone) else f"{type(error).__name__}: {error}"
                wait_s = next(backoff, BACKOFF_S[-1])
                if self._left_s(notice) < wait_s:
                    log.error("notice.failed", notice=notice.id, error=reason)
                    return reason
                log.warning("notice.retry", notice=notice.id, error=reason, retry_in_s=wait_s)
                await asyncio.sleep(wait_s)

    def _left_s(self, notice: Notice) -> float:
        return (notice.deadline - self.clock()).total_seconds()

    async def _call(
        self,
        what: str,
        call: Callable[[], Awaitable[T]],
        notice: Notice,
        *,
        retry_if: Callable[[ApiError], bool] = lambda error: error.transient,
    ) -> T:
        """One API call, its transient errors retried on a schedule of its own until the notice's deadline."""
        return await retrying(call, what=what, forever=True, left_s=lambda: self._left_s(notice), retry_if=retry_if)

    async def _node_name(self, notice: Notice) -> str | None:
        if self.local_node is not None:
            return self.local_node
        index = self.index
        assert index is not None, "queue mode needs a node index"
        return await self._call(
            "nodes.list", lambda: index.node_for(notice.instance_id, now=asyncio.get_running_loop().time()), notice
        )

    async def _act(self, notice: Notice, node: str, *, received: float) -> None:
        if notice.withdrawn:
            await self._withdraw(notice, node)
            await self.events.written(notice)
            return
        if notice.reckoned:
            # The node, not the agent, remembers when the notice was first seen: a restart must not move it.
            notice = resumed(await self._read(node, notice), notice)
        if notice.kind.definitive and self.board is not None:
            self.board.publish(node, notice)  # sidecars first: they leave rotation while the node is being patched
        if await self._mark(notice, node):
            self.metrics.notice_to_taint.observe(asyncio.get_running_loop().time() - received)
        if notice.kind.definitive and self.policy.evict:
            async with self._heartbeats(notice):
                await self.drainer.drain(node, deadline=notice.deadline, notice_id=notice.id)
        await self.events.written(notice)

    async def _mark(self, notice: Notice, name: str) -> bool:
        """Taint, cordon and annotate in one guarded patch; True if this call changed the node."""
        # In queue mode the node list the instance was found in serves as the first read: in a burst that halves
        # the calls before the taint. A stale copy costs a 409 and a fresh read, never a wrong patch.
        listed = self.index.take(name) if self.index is not None else None
        unanswered: list[ApiError] = []  # attempts of ours that may have been applied: no answer, or a 5xx
        for _ in range(CONFLICT_RETRIES):
            node = self._confirmed(name, listed, notice) if listed else await self._read(name, notice)
            patch = plan_mark(node, notice)
            if patch is None and listed is not None:
                listed = None  # "already marked" is only believed from a fresh read
                continue
            listed = None
            if patch is None and unanswered and marked_for(node) == notice.id:
                # Our own patch was applied and its answer lost: the node changed, so the Event is still ours to write.
                log.info("node.marked_unanswered", node=name, notice=notice.id, error=str(unanswered[-1]))
                self.events.write(node, notice, withdrawn=False)
                return True
            if patch is None:
                log.info("node.already_marked", node=name, notice=notice.id, marked_for=marked_for(node))
                return False
            try:
                await self._patch(name, patch, notice, unanswered=unanswered)
            except ApiError as error:
                if error.status != 409:
                    raise
                log.info("node.conflict", node=name, notice=notice.id)
                continue
            self._log_marked(name, notice, patch)
            self.events.write(node, notice, withdrawn=False)
            return True
        raise ApiError(409, f"node {name} kept changing while it was being marked")

    async def _withdraw(self, notice: Notice, name: str) -> None:
        if self.board is not None:
            self.board.withdraw(name, notice)
        unanswered: list[ApiError] = []
        for _ in range(CONFLICT_RETRIES):
            node = await self._read(name, notice)
            patch = plan_unmark(node) if marked_for(node) == notice.id else None
            if patch is None and unanswered and marked_for(node) is None:
                log.info("node.unmarked_unanswered", node=name, notice=notice.id, error=str(unanswered[-1]))
                self.events.write(node, notice, withdrawn=True)
                return
            if patch is None:
                log.info("node.nothing_to_withdraw", node=name, notice=notice.id)
                return
            try:
                await self._patch(name, patch, notice, unanswered=unanswered)
            except ApiError as error:
                if error.status != 409:
                    raise
                continue
            log.info("node.unmarked", node=name, notice=notice.id, removed=sorted(patch.get("spec", {})))
            self.events.write(node, notice, withdrawn=True)
            return
        raise ApiError(409, f"node {name} kept changing while it was being unmarked")

    async def _patch(self, name: str, patch: dict[str, Any], notice: Notice, *, unanswered: list[ApiError]) -> None:
        """Send ``patch``; each attempt that may have been applied though it failed is added to ``unanswered``."""

        async def patching() -> None:
            try:
                await self.actions.patch_node(name, patch)
            except ApiError as error:
                if error.status == 0 or error.status >= 500 or error.failure:
                    unanswered.append(error)
                raise

        # A 409 is not sent again: the patch is guarded by the resourceVersion it was planned from.
        await self._call("node.patch", patching, notice, retry_if=lambda error: error.transient and error.status != 409)

    async def _read(self, name: str, notice: Notice) -> Node:
        node = await self._call("node.read", functools.partial(self.actions.get_node, name), notice)
        if node is None:
            if self.index is not None:
                self.index.forget(notice.instance_id)
            raise NodeGone(f"node {name} not found")
        return self._confirmed(name, node, notice)

    def _confirmed(self, name: str, node: Node, notice: Notice) -> Node:
        """``node`` if it is the notice's instance. Every mark and withdrawal patches a node read this way, guarded by
        its resourceVersion, and the drain follows its mark at once.

        In queue mode the name comes from an earlier node list, and EKS names nodes after their private IP, which a
        new instance can reuse: a late notice for the old instance must not touch the new node. On a mismatch the
        instance is looked up afresh (NodeReplaced is retried like NodeGone), and a notice whose instance is no
        node any more goes back to its source as unmatched. In IMDS mode the node is the agent's own, named by the
        kubelet through the downward API, and the notice comes from that instance's own metadata service.
        """
        if self.index is None or (found := instance_id_of(node)) == notice.instance_id:
            return node
        self.index.forget(notice.instance_id)
        log.warning("node.replaced", node=name, notice=notice.id, instance=notice.instance_id, found=found)
        raise NodeReplaced(f"node {name} is instance {found} now, not {notice.instance_id}")

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
