"""What ``spotdrain check --node NAME`` says of one node, from the node, the pods on it and what its agent answers on
``/v1/status`` (agent/status.py): the notice source, the notice it holds, the model cache, the sidecars that ask it
for notices and the pods a notice would evict now. Pure functions of a ``NodeView``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from agent.drain.planning import plan_drain
from check import objects as o
from check.findings import Finding, Obj, error, listed, ok, warning

# A sidecar holds a long poll of up to 60 s (agent/drain/board.py MAX_WAIT_S) and asks again at once: one that has
# not asked for two holds is not listening.
SIDECAR_SILENT_AFTER = timedelta(seconds=120)
# The agent polls IMDS every second and backs off to 5 s while it fails: a last poll older than this is a stuck loop.
IMDS_STALE_AFTER = timedelta(seconds=30)
SPOT_NOTICE = timedelta(minutes=2)
EVICTION_MARGIN_S = 5.0  # agent/node_settings.py --eviction-margin


@dataclass(frozen=True)
class NodeView:
    name: str
    now: datetime
    node: Obj | None
    agent: Obj | None  # the agent's pod on the node
    status: dict[str, Any] | None  # the agent's /v1/status
    unreachable: str | None  # why the agent did not answer, when it did not
    pods: tuple[Obj, ...]  # every pod on the node


def _time(text: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def _ago(now: datetime, then: datetime) -> str:
    return f"{max(0.0, (now - then).total_seconds()):.0f} s ago"


def node_findings(view: NodeView) -> list[Finding]:
    if view.node is None:
        return [error("agent", f"no node {view.name} in the cluster", [], "kubectl get nodes")]
    if view.agent is None:
        fix = "spotdrain check (its agent group says why no agent runs there)"
        return [error("agent", f"no node agent pod on {view.name}", [f"Node/{view.name}"], fix)]
    agent_ref = o.ref("Pod", view.agent)
    logs = f"kubectl -n {o.namespace(view.agent)} logs {o.name(view.agent)} -c agent"
    if view.status is None:
        message = f"the node agent on {view.name} does not answer through the API server: {view.unreachable}"
        return [error("agent", message, [agent_ref], logs)]
    status = view.status
    findings = [_api(status, agent_ref, logs), _source(view, agent_ref, logs), _notice(view)]
    return [*findings, _cache(view), *_sidecars(view), _drain(view)]


def _api(status: dict[str, Any], agent_ref: str, logs: str) -> Finding:
    if not status.get("api_ready"):
        return error("agent", "the node agent has not reached the Kubernetes API (it is not ready)", [agent_ref], logs)
    evicts = "evicts the node's pods" if status.get("evict") else "does not evict (--no-evict): another component does"
    return ok("agent", f"the node agent is ready, in {status.get('mode')} mode, and {evicts}", agent_ref)


def _source(view: NodeView, agent_ref: str, logs: str) -> Finding:
    source = (view.status or {}).get("source") or {}
    if (view.status or {}).get("mode") == "queue":
        return ok("notice-sources", f"notices from the queue {source.get('url')}", agent_ref)
    last = _time(source.get("last_poll"))
    if last is None:
        return error(
            "notice-sources", f"the node agent has not polled IMDS ({source.get('url')}) yet", [agent_ref], logs
        )
    if source.get("failing"):
        message = (
            f"IMDS calls fail ({source['failing']}) at {source.get('url')}: notices may be missed; "
            f"last poll {_ago(view.now, last)}"
        )
        fix = "the EC2NodeClass must allow IMDSv2 with hop limit 1 and the agent run on the host network; " + logs
        return error("notice-sources", message, [agent_ref], fix)
    if view.now - last > IMDS_STALE_AFTER:
        message = f"the node agent last polled IMDS {_ago(view.now, last)}: its loop is stuck"
        return error(
            "notice-sources",
            message,
            [agent_ref],
            f"kubectl -n {o.namespace(view.agent or {})} delete pod {o.name(view.agent or {})}",
        )
    instance = source.get("instance_id") or "its instance"
    return ok("notice-sources", f"IMDS answers for {instance}: last poll {_ago(view.now, last)}", agent_ref)


def _notice(view: NodeView) -> Finding:
    notice = (view.status or {}).get("notice")
    if not notice:
        return ok("notice", f"no interruption notice for {view.name}")
    deadline = _time(notice.get("deadline"))
    left = "" if deadline is None else f" (in {(deadline - view.now).total_seconds():.0f} s)"
    message = f"{notice.get('kind')} from {notice.get('source')}, deadline {notice.get('deadline')}{left}: draining"
    return warning("notice", message, [f"Node/{view.name}"], "nothing to fix: the node is being drained")


def _cache(view: NodeView) -> Finding:
    node, cache = view.node or {}, (view.status or {}).get("cache") or {}
    if o.labels(node).get(o.CACHE_LABEL) == "ready":
        mounted = " and mounted" if cache.get("prepared_here") and cache.get("mounted") else ""
        return ok("model-cache", f"the model cache is ready{mounted} ({o.CACHE_LABEL}=ready)")
    if any(t.get("key") == o.CACHE_PENDING_TAINT for t in o.taints(node)):
        fix = f"kubectl -n {o.namespace(view.agent or {})} logs {o.name(view.agent or {})} -c model-cache"
        return warning("model-cache", f"{view.name} still carries {o.CACHE_PENDING_TAINT}", [f"Node/{view.name}"], fix)
    return warning(
        "model-cache", f"{view.name} has no model cache", [f"Node/{view.name}"], "see docs on the model cache"
    )


def _sidecars(view: NodeView) -> list[Finding]:
    callers = {address: _time(at) for address, at in ((view.status or {}).get("callers") or {}).items()}
    pods = [
        p for p in view.pods if o.running(o.spec(p), "sidecar") and (p.get("status") or {}).get("phase") == "Running"
    ]
    if not pods:
        return [ok("sidecars", f"no running pod with the sidecar on {view.name}")]
    silent = []
    for pod in pods:
        asked = callers.get(str((pod.get("status") or {}).get("podIP") or ""))
        if asked is None or view.now - asked > SIDECAR_SILENT_AFTER:
            silent.append(pod)
    answering = [o.ref("Pod", p) for p in pods if p not in silent]
    findings = (
        [ok("sidecars", f"{len(answering)} sidecars ask the agent for notices: {listed(answering)}")]
        if answering
        else []
    )
    for pod in silent:
        message = (
            f"{o.namespace(pod)}/{o.name(pod)} has the sidecar but has not asked the agent for a notice in "
            f"{SIDECAR_SILENT_AFTER.total_seconds():.0f} s: it will hear of an interruption only at SIGTERM"
        )
        fix = (
            "its --notice-url must be the agent's http://$(HOST_IP):8090/v1/notice; "
            f"kubectl -n {o.namespace(pod)} logs {o.name(pod)} -c {o.SIDECAR}"
        )
        findings.append(error("sidecars", message, [o.ref("Pod", pod)], fix))
    return findings


def _drain(view: NodeView) -> Finding:
    agent = view.agent or {}
    evictions = plan_drain(
        [dict(p) for p in view.pods],
        deadline=view.now + SPOT_NOTICE,
        now=view.now,
        margin_s=EVICTION_MARGIN_S,
        agent_pod=(o.namespace(agent), o.name(agent)),
    )
    who = "the agent would evict" if (view.status or {}).get("evict") else "the component that evicts would evict"
    if not evictions:
        return ok("drain", f"a Spot notice now would leave nothing to evict on {view.name}")
    names = listed([f"{e.namespace}/{e.name} ({e.grace_s} s)" for e in evictions], most=10)
    return ok("drain", f"on a Spot notice now, {who} {len(evictions)} pods: {names}")
