"""The node handler at its own seam: a recording fake of the node actions, and a virtual clock."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.drain.board import NoticeBoard
from agent.drain.eviction import Drainer, DrainPolicy
from agent.drain.handler import HandlerPolicy, NodeHandler
from agent.drain.metrics import AgentMetrics
from agent.drain.nodes import DryRunActions, NodeActions, NodeIndex
from agent.drain.planning import MIRROR, TAINT_KEY
from agent.notices.notice import Kind, Notice, Source
from simulate.fakes.kube_patch import merge_patch
from spotdrain.metrics import CollectorRegistry
from spotdrain.retry import ApiError

T0 = datetime(2026, 11, 29, 10, 20, tzinfo=UTC)


class RecordingActions:
    """Nodes and pods in memory, applying merge patches with the API server's resourceVersion check."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, ...]] = []
        self.events: list[tuple[str, str]] = []
        self.version = 1
        self.fail: dict[str, list[ApiError]] = {}
        self.answers_lost = 0  # node patches applied whose answer is then lost
        self.pdb_blocks_until: float = 0.0

    def add_node(self, name: str, instance_id: str, **spec: Any) -> None:
        self.version += 1
        self.nodes[name] = {
            "metadata": {"name": name, "resourceVersion": str(self.version), "annotations": {}},
            "spec": {"providerID": f"aws:///us-east-1a/{instance_id}", **spec},
        }

    def add_pod(self, name: str, node: str, **meta: Any) -> None:
        self.pods[name] = {
            "metadata": {"namespace": "ml", "name": name, **meta},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 130},
            "status": {"phase": "Running"},
        }

    def _maybe_fail(self, call: str) -> None:
        if self.fail.get(call):
            raise self.fail[call].pop(0)

    async def get_node(self, name: str) -> dict[str, Any] | None:
        self.calls.append(("get_node", name))
        return copy.deepcopy(self.nodes.get(name))

    async def list_nodes(self) -> list[dict[str, Any]]:
        self.calls.append(("list_nodes",))
        return copy.deepcopy(list(self.nodes.values()))

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("patch_node", name))
        self._maybe_fail("patch_node")
        if patch["metadata"]["resourceVersion"] != self.nodes[name]["metadata"]["resourceVersion"]:
            raise ApiError(409, "the object has been modified")
        self.version += 1
        updated = merge_patch(self.nodes[name], patch)
        updated["metadata"]["resourceVersion"] = str(self.version)
        self.nodes[name] = updated
        if self.answers_lost:
            self.answers_lost -= 1
            raise ApiError(0, "connection lost", failure="timeout")
        return copy.deepcopy(updated)

    async def pods_on(self, node: str) -> list[dict[str, Any]]:
        self.calls.append(("pods_on", node))
        return [copy.deepcopy(p) for p in self.pods.values() if p["spec"]["nodeName"] == node]

    async def evict(self, namespace: str, name: str, *, grace_s: int) -> None:
        self.calls.append(("evict", name, str(grace_s)))
        if asyncio.get_running_loop().time() < self.pdb_blocks_until:
            raise ApiError(429, "Cannot evict pod as it would violate the pod's disruption budget.")
        if name not in self.pods:
            raise ApiError(404, "not found")
        # The pod terminates right away here; the grace period is what the handler chose, recorded above.
        del self.pods[name]

    async def event(self, node: dict[str, Any], *, reason: str, message: str, warning: bool) -> None:
        self.events.append((reason, message))


class RecordingAck:
    def __init__(self) -> None:
        self.said: list[str] = []

    async def succeeded(self) -> None:
        self.said.append("succeeded")

    async def retry(self, reason: str) -> None:
        self.said.append(f"retry: {reason}")

    async def drop(self, reason: str) -> None:
        self.said.append(f"drop: {reason}")

    async def heartbeat(self) -> None:
        self.said.append("heartbeat")


def clock() -> datetime:
    return T0 + timedelta(seconds=asyncio.get_running_loop().time())


def handler_for(
    actions: NodeActions, *, local_node: str | None = "gpu-1", evict: bool = True
) -> tuple[NodeHandler, NoticeBoard, AgentMetrics]:
    metrics = AgentMetrics.create(CollectorRegistry())
    board = NoticeBoard(local_node=local_node)
    drainer = Drainer(
        actions, policy=DrainPolicy(5.0, ("kube-system", "spotdrain-abc"), delay_s=1.0), metrics=metrics, clock=clock
    )
    handler = NodeHandler(
        actions,
        drainer,
        policy=HandlerPolicy(evict=evict, heartbeat_s=10.0),
        metrics=metrics,
        clock=clock,
        board=board,
        local_node=local_node,
        index=None if local_node else NodeIndex(actions),
    )
    return handler, board, metrics


def spot(*, seconds: float = 120, ack: RecordingAck | None = None, source: Source = Source.IMDS) -> Notice:
    return Notice(Kind.SPOT_INTERRUPTION, "i-0abc", T0 + timedelta(seconds=seconds), source, "terminate", ack=ack)


@pytest.fixture
def actions() -> RecordingActions:
    fake = RecordingActions()
    fake.add_node("gpu-1", "i-0abc")
    fake.add_pod("vllm-0", "gpu-1")
    fake.add_pod("vllm-1", "gpu-1")
    fake.add_pod("fluent-bit", "gpu-1", ownerReferences=[{"kind": "DaemonSet", "name": "fluent-bit"}])
    fake.add_pod("static", "gpu-1", annotations={MIRROR: "x"})
    return fake


@pytest.mark.looptime
async def test_a_spot_warning_marks_publishes_and_evicts_within_the_deadline(actions: RecordingActions) -> None:
    ack = RecordingAck()
    handler, board, _ = handler_for(actions)
    await handler.handle(spot(ack=ack, source=Source.SQS))
    node = actions.nodes["gpu-1"]
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == [{"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"]["spotdrain.io/termination-time"] == "2026-11-29T10:22:00Z"
    assert [e[0] for e in actions.events] == ["InterruptionNotice"]
    assert board.by_node["gpu-1"].kind is Kind.SPOT_INTERRUPTION
    evictions = [c for c in actions.calls if c[0] == "evict"]
    assert sorted(evictions) == [("evict", "vllm-0", "114"), ("evict", "vllm-1", "114")]  # 120 - 1 s delay - 5 s
    assert set(actions.pods) == {"fluent-bit", "static"}
    assert ack.said == ["succeeded"]


@pytest.mark.looptime
async def test_the_node_is_marked_before_any_eviction(actions: RecordingActions) -> None:
    handler, _, _ = handler_for(actions)
    await handler.handle(spot())
    names = [c[0] for c in actions.calls]
    assert names.index("patch_node") < names.index("evict")


@pytest.mark.looptime
async def test_a_restarted_agent_resumes_without_doing_anything_twice(actions: RecordingActions) -> None:
    first, _, _ = handler_for(actions, evict=False)
    await first.handle(spot())
    actions.pods["vllm-0"]["metadata"]["deletionTimestamp"] = "2026-11-29T10:20:30Z"
    actions.calls.clear()
    restarted, _, _ = handler_for(actions)
    await restarted.handle(spot())
    assert "patch_node" not in [c[0] for c in actions.calls]
    assert [c[1] for c in actions.calls if c[0] == "evict"] == ["vllm-1"]
    assert len(actions.events) == 1


@pytest.mark.looptime
async def test_a_restarted_agent_waits_for_the_pods_already_terminating_before_acknowledging(
    actions: RecordingActions,
) -> None:
    first, _, _ = handler_for(actions, evict=False)
    await first.handle(spot())
    actions.pods["vllm-0"]["metadata"]["deletionTimestamp"] = "2026-11-29T10:20:30Z"
    ack = RecordingAck()
    restarted, _, _ = handler_for(actions)

    async def kubelet_removes_the_terminating_pod() -> None:
        await asyncio.sleep(30)
        del actions.pods["vllm-0"]

    removal = asyncio.create_task(kubelet_removes_the_terminating_pod())
    started = asyncio.get_running_loop().time()
    await restarted.handle(spot(ack=ack, source=Source.SQS))
    assert asyncio.get_running_loop().time() - started >= 30
    assert removal.done()
    assert ack.said.count("succeeded") == 1
    assert ack.said[-1] == "succeeded"


@pytest.mark.looptime
async def test_a_rebalance_recommendation_only_adds_a_soft_taint(actions: RecordingActions) -> None:
    handler, board, _ = handler_for(actions)
    await handler.handle(Notice(Kind.REBALANCE_RECOMMENDATION, "i-0abc", T0 + timedelta(seconds=120), Source.IMDS))
    node = actions.nodes["gpu-1"]
    assert node["spec"]["taints"][0]["effect"] == "PreferNoSchedule"
    assert not node["spec"].get("unschedulable")
    assert board.by_node == {}
    assert "evict" not in [c[0] for c in actions.calls]


@pytest.mark.looptime
async def test_a_rebalance_after_a_spot_warning_and_a_restart_change_nothing(actions: RecordingActions) -> None:
    rebalance = Notice(Kind.REBALANCE_RECOMMENDATION, "i-0abc", T0 + timedelta(seconds=120), Source.IMDS)
    handler, _, _ = handler_for(actions, evict=False)
    await handler.handle(spot())
    await handler.handle(rebalance)
    restarted, _, _ = handler_for(actions, evict=False)
    await restarted.handle(rebalance)
    await restarted.handle(spot())
    node = actions.nodes["gpu-1"]
    assert node["spec"]["taints"] == [{"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"}]
    assert node["metadata"]["annotations"]["spotdrain.io/notice"] == spot().id
    assert [c[0] for c in actions.calls].count("patch_node") == 1
    assert [e[0] for e in actions.events] == ["InterruptionNotice"]


@pytest.mark.looptime
async def test_a_restart_keeps_the_first_reckoned_deadline(actions: RecordingActions) -> None:
    first = Notice(Kind.ASG_TERMINATION, "i-0abc", T0 + timedelta(seconds=120), Source.IMDS, "Terminated")
    handler, _, _ = handler_for(actions, evict=False)
    await handler.handle(first)
    restarted, board, _ = handler_for(actions)
    await asyncio.sleep(30)
    await restarted.handle(
        Notice(Kind.ASG_TERMINATION, "i-0abc", T0 + timedelta(seconds=150), Source.IMDS, "Terminated")
    )
    assert actions.nodes["gpu-1"]["metadata"]["annotations"]["spotdrain.io/termination-time"] == "2026-11-29T10:22:00Z"
    assert board.by_node["gpu-1"].deadline == first.deadline, "the sidecars are told the first deadline"
    assert [c[0] for c in actions.calls].count("patch_node") == 1
    assert {c[2] for c in actions.calls if c[0] == "evict"} == {"84"}  # 120 - 30 s later - 1 s delay - 5 s margin


@pytest.mark.looptime
async def test_a_withdrawn_maintenance_event_undoes_only_its_own_marks(actions: RecordingActions) -> None:
    handler, board, _ = handler_for(actions, evict=False)
    event = Notice(Kind.SCHEDULED_MAINTENANCE, "i-0abc", T0 + timedelta(hours=2), Source.IMDS, "instance-event-1")
    await handler.handle(event)
    assert actions.nodes["gpu-1"]["spec"]["unschedulable"] is True
    other = Notice(Kind.SCHEDULED_MAINTENANCE, "i-0abc", T0 + timedelta(hours=3), Source.IMDS, "instance-event-2")
    await handler.handle(Notice(**{**other.__dict__, "withdrawn": True}))
    assert actions.nodes["gpu-1"]["spec"]["unschedulable"] is True, "another event's withdrawal changes nothing"
    await handler.handle(Notice(**{**event.__dict__, "withdrawn": True}))
    node = actions.nodes["gpu-1"]
    assert "unschedulable" not in node["spec"]
    assert "taints" not in node["spec"]
    assert board.by_node == {}
    assert [e[0] for e in actions.events] == ["InterruptionNotice", "InterruptionWithdrawn"]


@pytest.mark.looptime
async def test_a_patch_applied_whose_answer_was_lost_still_gets_its_event(actions: RecordingActions) -> None:
    handler, _, _ = handler_for(actions, evict=False)
    event = Notice(Kind.SCHEDULED_MAINTENANCE, "i-0abc", T0 + timedelta(hours=2), Source.IMDS, "instance-event-1")
    actions.answers_lost = 1
    await handler.handle(event)
    assert actions.nodes["gpu-1"]["spec"]["unschedulable"] is True
    actions.answers_lost = 1
    await handler.handle(replace(event, withdrawn=True))
    assert "unschedulable" not in actions.nodes["gpu-1"]["spec"]
    assert [c[0] for c in actions.calls].count("patch_node") == 4, "each lost answer costs one 409"
    assert [e[0] for e in actions.events] == ["InterruptionNotice", "InterruptionWithdrawn"]


@pytest.mark.looptime
async def test_a_conflict_is_resolved_by_reading_the_node_again(actions: RecordingActions) -> None:
    actions.fail["patch_node"] = [ApiError(409, "the object has been modified")]
    handler, _, _ = handler_for(actions, evict=False)
    await handler.handle(spot())
    assert [c[0] for c in actions.calls].count("patch_node") == 2
    assert actions.nodes["gpu-1"]["spec"]["unschedulable"] is True


@pytest.mark.looptime
async def test_evictions_blocked_by_a_disruption_budget_are_retried_until_allowed(actions: RecordingActions) -> None:
    actions.pdb_blocks_until = 20.0
    handler, _, metrics = handler_for(actions)
    await handler.handle(spot())
    assert actions.pods.keys() == {"fluent-bit", "static"}
    grace = sorted(int(c[2]) for c in actions.calls if c[0] == "evict")
    assert grace[0] < grace[-1] == 114, "later attempts get less grace: the deadline does not move"
    assert metrics.evictions.labels(result="evicted")._value.get() == 2


@pytest.mark.looptime
async def test_no_eviction_is_an_immediate_deletion_however_close_the_deadline(actions: RecordingActions) -> None:
    actions.pdb_blocks_until = 6.0  # retried until past the deadline's margin, then right up to the deadline
    handler, _, _ = handler_for(actions)
    await handler.handle(spot(seconds=8))
    grace = [int(c[2]) for c in actions.calls if c[0] == "evict"]
    assert len(grace) > 2
    assert min(grace) == 1, "grace 0 deletes at once: no preStop, so the streams are cut"


@pytest.mark.looptime
async def test_evictions_still_blocked_at_the_deadline_are_given_up_and_reported(actions: RecordingActions) -> None:
    actions.pdb_blocks_until = 1e9
    ack = RecordingAck()
    handler, _, metrics = handler_for(actions)
    started = asyncio.get_running_loop().time()
    await handler.handle(spot(ack=ack))
    assert asyncio.get_running_loop().time() - started <= 120
    assert metrics.evictions.labels(result="gave_up")._value.get() == 2
    assert ack.said[-1] == "succeeded"


@pytest.mark.looptime
async def test_a_notice_for_an_instance_not_in_the_cluster_is_handed_back(actions: RecordingActions) -> None:
    ack = RecordingAck()
    handler, _, metrics = handler_for(actions, local_node=None)
    await handler.handle(Notice(Kind.SPOT_INTERRUPTION, "i-0zzz", T0 + timedelta(seconds=120), Source.SQS, ack=ack))
    assert ack.said == ["retry: instance i-0zzz is not a node of this cluster"]
    assert metrics.unknown_instances._value.get() == 1


@pytest.mark.looptime
async def test_queue_mode_finds_the_node_by_provider_id(actions: RecordingActions) -> None:
    actions.add_node("gpu-2", "i-0def")
    handler, board, _ = handler_for(actions, local_node=None, evict=False)
    await handler.handle(Notice(Kind.SPOT_INTERRUPTION, "i-0def", T0 + timedelta(seconds=120), Source.SQS))
    assert actions.nodes["gpu-2"]["spec"]["unschedulable"] is True
    assert "unschedulable" not in actions.nodes["gpu-1"]["spec"]
    assert set(board.by_node) == {"gpu-2"}


@pytest.mark.looptime
async def test_queue_mode_touches_no_node_that_is_another_instance_now(actions: RecordingActions) -> None:
    handler, _, _ = handler_for(actions, local_node=None, evict=False)
    earlier = Notice(Kind.HEALTH_SCHEDULED_CHANGE, "i-0abc", T0 + timedelta(days=1), Source.SQS, "arn:1")
    await handler.handle(earlier)  # the index learns i-0abc -> gpu-1
    actions.add_node("gpu-1", "i-0new")  # EKS names nodes after the private IP: a new instance got it
    marking, withdrawing = RecordingAck(), RecordingAck()
    await handler.handle(spot(ack=marking, source=Source.SQS))
    await handler.handle(replace(earlier, withdrawn=True, ack=withdrawing))
    assert marking.said == withdrawing.said == ["retry: instance i-0abc is not a node of this cluster"]
    assert actions.nodes["gpu-1"]["spec"] == {"providerID": "aws:///us-east-1a/i-0new"}
    assert [c for c in actions.calls if c[0] == "patch_node"] == [("patch_node", "gpu-1")], "the old node's mark only"
    assert [c[0] for c in actions.calls].count("list_nodes") == 2, "a mismatch looks the instance up afresh"


@pytest.mark.looptime
async def test_a_duplicate_delivery_waits_for_the_first_and_both_are_acknowledged(actions: RecordingActions) -> None:
    first, second = RecordingAck(), RecordingAck()
    handler, _, _ = handler_for(actions)
    await asyncio.gather(handler.handle(spot(ack=first)), handler.handle(spot(ack=second)))
    assert first.said == second.said == ["succeeded"]
    assert len([c for c in actions.calls if c[0] == "evict"]) == 2


@pytest.mark.looptime
async def test_a_long_drain_sends_heartbeats(actions: RecordingActions) -> None:
    actions.pdb_blocks_until = 35.0
    ack = RecordingAck()
    handler, _, _ = handler_for(actions)
    await handler.handle(spot(ack=ack))
    assert ack.said.count("heartbeat") >= 3
    assert ack.said[-1] == "succeeded"


@pytest.mark.looptime
async def test_api_failures_are_retried_until_the_deadline_then_handed_back(actions: RecordingActions) -> None:
    actions.fail["patch_node"] = [ApiError(503, "unavailable")] * 1000
    ack = RecordingAck()
    handler, _, _ = handler_for(actions)
    await handler.handle(spot(seconds=30, ack=ack))
    assert ack.said == ["retry: HTTP 503: unavailable"]
    assert asyncio.get_running_loop().time() <= 30


@pytest.mark.looptime
async def test_a_dry_run_reads_but_changes_nothing(actions: RecordingActions) -> None:
    before = copy.deepcopy(actions.nodes)
    handler, _, _ = handler_for(DryRunActions(actions))
    with capture_logs() as logs:
        await handler.handle(spot())
    assert asyncio.get_running_loop().time() < 5, "the dry run does not wait for pods it did not evict"
    assert {e["event"] for e in logs} >= {"dry_run.patch_node", "dry_run.evict", "dry_run.event"}
    assert actions.nodes == before
    assert len(actions.pods) == 4
    assert {c[0] for c in actions.calls} <= {"get_node", "pods_on", "list_nodes"}


async def test_concurrent_lookups_share_one_node_list(actions: RecordingActions) -> None:
    actions.add_node("gpu-2", "i-0def")
    index = NodeIndex(actions)
    found = await asyncio.gather(*(index.node_for(i, now=0.0) for i in ("i-0abc", "i-0def", "i-0zzz")))
    assert found == ["gpu-1", "gpu-2", None]
    assert await index.node_for("i-0zzz", now=1.0) is None
    assert actions.calls.count(("list_nodes",)) == 1, "a miss right after a LIST does not list again"
    assert await index.node_for("i-0zzz", now=6.0) is None
    assert actions.calls.count(("list_nodes",)) == 2


@pytest.mark.looptime
async def test_queue_mode_patches_from_the_listed_node_and_rereads_only_on_conflict(actions: RecordingActions) -> None:
    actions.add_node("gpu-2", "i-0def")
    handler, _, _ = handler_for(actions, local_node=None, evict=False)
    await handler.handle(Notice(Kind.SPOT_INTERRUPTION, "i-0def", T0 + timedelta(seconds=120), Source.SQS))
    assert [c[0] for c in actions.calls] == ["list_nodes", "patch_node"]
    actions.calls.clear()
    assert handler.index is not None
    await handler.index._refresh(100.0)
    actions.nodes["gpu-1"]["metadata"]["resourceVersion"] = "changed-since-the-list"
    await handler.handle(Notice(Kind.SPOT_INTERRUPTION, "i-0abc", T0 + timedelta(seconds=120), Source.SQS))
    assert [c[0] for c in actions.calls] == ["list_nodes", "patch_node", "get_node", "patch_node"]
    assert actions.nodes["gpu-1"]["spec"]["unschedulable"] is True
