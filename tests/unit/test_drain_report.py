"""What the node agent reports once a drain returns: the pods it evicted and the ones it could not."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from agent.drain.eviction import Drainer, DrainPolicy
from agent.drain.metrics import AgentMetrics
from spotdrain.metrics import CollectorRegistry
from tests.unit.test_handler import T0, RecordingActions, clock


def drainer(actions: RecordingActions) -> Drainer:
    metrics = AgentMetrics.create(CollectorRegistry())
    return Drainer(actions, policy=DrainPolicy(5.0, None, delay_s=1.0), metrics=metrics, clock=clock)


def two_pods() -> RecordingActions:
    actions = RecordingActions()
    actions.add_node("gpu-1", "i-0abc")
    actions.add_pod("vllm-0", "gpu-1")
    actions.add_pod("vllm-1", "gpu-1")
    return actions


@pytest.mark.looptime
async def test_a_drain_whose_evictions_were_refused_to_the_end_names_the_pods_it_left() -> None:
    actions = two_pods()
    actions.pdb_blocks_until = 1e9
    with capture_logs() as logs:
        drained = await drainer(actions).drain("gpu-1", deadline=T0.replace(minute=22), notice_id="n1")
    assert (drained.evicted, drained.not_evicted) == ({}, ("ml/vllm-0", "ml/vllm-1"))
    [last] = [e for e in logs if e["event"] == "node.drained"]
    assert (last["log_level"], last["evicted"], last["not_evicted"]) == ("warning", {}, ["ml/vllm-0", "ml/vllm-1"])
    assert logs.index(last) > max(i for i, e in enumerate(logs) if e["event"] == "pod.eviction_failed")


@pytest.mark.looptime
async def test_a_drain_that_evicted_everything_reports_how_long_each_pod_took() -> None:
    actions = two_pods()
    with capture_logs() as logs:
        drained = await drainer(actions).drain("gpu-1", deadline=T0.replace(minute=22), notice_id="n1")
    assert sorted(drained.evicted) == ["ml/vllm-0", "ml/vllm-1"]
    assert drained.not_evicted == ()
    [last] = [e for e in logs if e["event"] == "node.drained"]
    assert (last["log_level"], sorted(last["evicted"]), last["not_evicted"]) == ("info", sorted(drained.evicted), [])
