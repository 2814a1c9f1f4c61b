"""What ``spotdrain check --node`` makes of what an agent answers: each way its notice source, its notice and its
node can be, read from ``/v1/status`` as agent/status.py writes it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from check.node_findings import NodeView, node_findings

NOW = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
NODE = {"metadata": {"name": "gpu-1", "labels": {"spotdrain.io/model-cache": "ready"}}}
AGENT = {"metadata": {"name": "spotdrain-node-a", "namespace": "spotdrain"}, "spec": {"containers": []}}


def status(**changes: Any) -> dict[str, Any]:
    source = {
        "url": "http://169.254.169.254",
        "instance_id": "i-1",
        "last_poll": "2026-12-03T07:59:59Z",
        "failing": None,
    }
    base: dict[str, Any] = {
        "node": "gpu-1",
        "mode": "imds",
        "evict": True,
        "api_ready": True,
        "source": source,
        "notice": None,
        "cache": {"path": "/mnt/model-cache", "prepared_here": False, "mounted": False},
        "waiting": 0,
        "callers": {},
    }
    return base | changes


def messages(answer: dict[str, Any] | None, *, node: dict[str, Any] = NODE, why: str | None = None) -> dict[str, str]:
    view = NodeView("gpu-1", NOW, node, AGENT, answer, why, ())
    return {f.check: f"{f.severity}: {f.message}" for f in node_findings(view)}


def test_a_healthy_agent_is_all_ok() -> None:
    found = messages(status())
    assert all(text.startswith("ok: ") for text in found.values()), found
    assert found["notice-sources"] == "ok: IMDS answers for i-1: last poll 1 s ago"
    assert found["drain"] == "ok: a Spot notice now would leave nothing to evict on gpu-1"


def test_imds_failing_or_stuck_or_never_polled_is_an_error() -> None:
    failing = status(source={"url": "http://imds", "last_poll": "2026-12-03T07:59:59Z", "failing": "timeout"})
    assert messages(failing)["notice-sources"].startswith("error: IMDS calls fail (timeout) at http://imds")
    stuck = status(source={"url": "http://imds", "last_poll": "2026-12-03T07:58:00Z", "failing": None})
    assert messages(stuck)["notice-sources"] == "error: the node agent last polled IMDS 120 s ago: its loop is stuck"
    never = status(source={"url": "http://imds", "last_poll": None, "failing": None})
    assert messages(never)["notice-sources"] == "error: the node agent has not polled IMDS (http://imds) yet"


def test_a_notice_in_hand_is_shown_with_its_deadline() -> None:
    notice = {"id": "n1", "kind": "spot-interruption", "deadline": "2026-12-03T08:01:30Z", "source": "imds"}
    assert messages(status(notice=notice))["notice"] == (
        "warning: spot-interruption from imds, deadline 2026-12-03T08:01:30Z (in 90 s): draining"
    )


def test_an_agent_without_the_api_or_an_answer_is_an_error() -> None:
    assert messages(status(api_ready=False))["agent"].startswith("error: the node agent has not reached the Kubernetes")
    assert messages(None, why="HTTP 503: no route")["agent"] == (
        "error: the node agent on gpu-1 does not answer through the API server: HTTP 503: no route"
    )


def test_a_node_still_preparing_its_cache_is_a_warning() -> None:
    node = {"metadata": {"name": "gpu-1"}, "spec": {"taints": [{"key": "spotdrain.io/model-cache-pending"}]}}
    assert (
        messages(status(), node=node)["model-cache"] == "warning: gpu-1 still carries spotdrain.io/model-cache-pending"
    )


def test_a_caller_that_asked_too_long_ago_is_silent() -> None:
    sidecar = {"name": "spotdrain", "command": ["spotdrain", "sidecar"]}
    pod = {
        "metadata": {"name": "vllm-0", "namespace": "inference"},
        "spec": {"containers": [sidecar]},
        "status": {"phase": "Running", "podIP": "10.0.0.7"},
    }
    long_ago = (NOW - timedelta(minutes=3)).isoformat()
    view = NodeView("gpu-1", NOW, NODE, AGENT, status(callers={"10.0.0.7": long_ago}), None, (pod,))
    [silent] = [f for f in node_findings(view) if f.check == "sidecars"]
    assert (silent.severity, silent.objects) == ("error", ("Pod/inference/vllm-0",))
