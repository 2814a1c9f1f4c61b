"""The checks of what runs once per cluster or per node: the node agent on every GPU node, exactly one component that
evicts, and the model cache on every GPU node. Pure functions of a ``Snapshot``."""

from __future__ import annotations

from datetime import datetime, timedelta

from check import objects as o
from check.findings import Finding, Obj, Snapshot, error, listed, ok, warning

# A node's startup taint is removed once its cache is mounted, a minute or two after boot; longer is a failed step.
CACHE_PENDING_TOO_LONG = timedelta(minutes=10)

# The DaemonSet controller adds these tolerations to every DaemonSet pod, whatever its template says
# (pkg/controller/daemon/util/daemonset_util.go, AddOrUpdateDaemonPodTolerations): they never keep an agent off.
_DAEMON_TOLERATIONS = tuple(
    {"key": key, "operator": "Exists", "effect": effect}
    for key, effect in (
        ("node.kubernetes.io/not-ready", "NoExecute"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
        ("node.kubernetes.io/disk-pressure", "NoSchedule"),
        ("node.kubernetes.io/memory-pressure", "NoSchedule"),
        ("node.kubernetes.io/pid-pressure", "NoSchedule"),
        ("node.kubernetes.io/unschedulable", "NoSchedule"),
        ("node.kubernetes.io/network-unavailable", "NoSchedule"),
    )
)


def agent_daemonsets(snapshot: Snapshot) -> list[Obj]:
    return [ds for ds in snapshot.daemonsets if o.running(o.template_spec(ds), "node")]


def queue_deployments(snapshot: Snapshot) -> list[Obj]:
    return [d for d in snapshot.deployments if (c := o.running(o.template_spec(d), "node")) and o.queue_mode(c)]


def gpu_nodes(snapshot: Snapshot) -> list[Obj]:
    return [node for node in snapshot.nodes if o.is_gpu_node(node)]


def check_agent(snapshot: Snapshot) -> list[Finding]:
    daemonsets, nodes = agent_daemonsets(snapshot), gpu_nodes(snapshot)
    if not daemonsets:
        fix = "kubectl apply -k daemonset/imds-mode (or the overlay of your mode)"
        return [error("agent", "no node agent DaemonSet (spotdrain node) in the cluster", [], fix)]
    found = [_agent_on(node, daemonsets, snapshot.agent_pods) for node in nodes]
    problems = [finding for finding in found if finding is not None]
    refs = [o.ref("DaemonSet", ds) for ds in daemonsets]
    return problems or [ok("agent", f"the node agent is ready on {len(nodes)} of {len(nodes)} GPU nodes", *refs)]


def _agent_on(node: Obj, daemonsets: list[Obj], pods: tuple[Obj, ...]) -> Finding | None:
    node_name = o.name(node)
    mine = [p for p in pods if o.spec(p).get("nodeName") == node_name]
    node_ref = o.ref("Node", node)
    if any(o.is_ready(p) for p in mine):
        return None
    if mine:
        pod = mine[0]
        where = f"kubectl -n {o.namespace(pod)}"
        fix = f"{where} describe pod {o.name(pod)}; {where} logs {o.name(pod)}"
        return error("agent", f"the node agent on {node_name} is not ready", [node_ref, o.ref("Pod", pod)], fix)
    daemonset = daemonsets[0]
    ds_ref = o.ref("DaemonSet", daemonset)
    tolerations = [t for t in o.template_spec(daemonset).get("tolerations") or [] if isinstance(t, dict)]
    blocking = o.blocking_taints(node, [*tolerations, *_DAEMON_TOLERATIONS])
    if blocking:
        texts = [o.taint_text(t) for t in blocking]
        wanted = ", ".join(f"{{key: {t.get('key')}, operator: Exists, effect: {t.get('effect')}}}" for t in blocking)
        message = f"no node agent on {node_name}: its taint {', '.join(texts)} is not tolerated by {ds_ref}"
        fix = f"add to {ds_ref} spec.template.spec.tolerations: {wanted} (or one {{operator: Exists}})"
        return error("agent", message, [node_ref, ds_ref], fix)
    fix = (
        f"kubectl -n {o.namespace(daemonset)} describe daemonset {o.name(daemonset)}; kubectl describe node {node_name}"
    )
    message = f"no node agent on {node_name}: {ds_ref} has no pod there (its node affinity, or the node is full)"
    return error("agent", message, [node_ref, ds_ref], fix)


def _evictors(snapshot: Snapshot) -> list[tuple[str, str]]:
    """(object, what it is) for each component that evicts pods when an interruption comes."""
    found: list[tuple[str, str]] = []
    for deployment in snapshot.deployments:
        for container in o.containers(o.template_spec(deployment)):
            queue = o.env_value(container, "INTERRUPTION_QUEUE") or o.flag_value(container, "--interruption-queue")
            if "karpenter" in str(container.get("image", "")) and queue:
                found.append((o.ref("Deployment", deployment), f"Karpenter with the interruption queue {queue}"))
    for deployment in queue_deployments(snapshot):
        agent = o.running(o.template_spec(deployment), "node")
        if agent is not None and o.evicts(agent):
            found.append((o.ref("Deployment", deployment), "the spotdrain queue Deployment"))
    for daemonset in agent_daemonsets(snapshot):
        agent = o.running(o.template_spec(daemonset), "node")
        if agent is not None and o.evicts(agent):
            found.append((o.ref("DaemonSet", daemonset), "the spotdrain DaemonSet (IMDS mode, evicting)"))
    return found


def check_interruption_sources(snapshot: Snapshot) -> list[Finding]:
    evictors = _evictors(snapshot)
    refs = [ref for ref, _ in evictors]
    if len(evictors) == 1:
        return [ok("interruption-sources", f"one component evicts: {evictors[0][1]}", *refs)]
    if not evictors:
        message = "nothing evicts pods when an interruption comes: they go down with the instance"
        fix = "kubectl apply -k daemonset/imds-mode, or set Karpenter's settings.interruptionQueue"
        return [error("interruption-sources", message, [], fix)]
    message = f"{len(evictors)} components evict, and their drains race: {'; '.join(what for _, what in evictors)}"
    karpenter = any(what.startswith("Karpenter") for _, what in evictors)
    if karpenter:
        fix = "kubectl apply -k daemonset/karpenter-interruption (agents with --no-evict); delete any queue Deployment"
    else:
        fix = "kubectl apply -k daemonset/queue-mode (its DaemonSet runs --no-evict)"
    return [error("interruption-sources", message, refs, fix)]


def check_model_cache(snapshot: Snapshot) -> list[Finding]:
    findings: list[Finding] = []
    stuck: list[str] = []
    pending: list[str] = []
    bare: list[str] = []
    for node in gpu_nodes(snapshot):
        if any(t.get("key") == o.CACHE_PENDING_TAINT for t in o.taints(node)):
            (stuck if _age(node, snapshot.now) > CACHE_PENDING_TOO_LONG else pending).append(o.name(node))
        elif o.labels(node).get(o.CACHE_LABEL) != "ready":
            bare.append(o.name(node))
    if stuck:
        message = (
            f"{listed(stuck)} still carry the startup taint {o.CACHE_PENDING_TAINT} after "
            f"{int(CACHE_PENDING_TOO_LONG.total_seconds() // 60)} minutes: no inference pod schedules there"
        )
        fix = "kubectl -n spotdrain logs -c model-cache <the agent pod on the node> (the cache step says what failed)"
        findings.append(error("model-cache", message, [f"Node/{n}" for n in stuck], fix))
    if pending:
        message = f"{listed(pending)} are preparing their model cache (startup taint still on)"
        findings.append(
            warning("model-cache", message, [f"Node/{n}" for n in pending], "wait a minute, then check again")
        )
    if bare:
        message = f"{listed(bare)} have no model cache (no label {o.CACHE_LABEL}=ready): pods that need it go elsewhere"
        fix = "check that the agent's init container ran on them: kubectl -n spotdrain get pods -o wide"
        findings.append(warning("model-cache", message, [f"Node/{n}" for n in bare], fix))
    return findings or [ok("model-cache", f"the model cache is ready on {len(gpu_nodes(snapshot))} GPU nodes")]


def _age(node: Obj, now: datetime) -> timedelta:
    created = o.meta(node).get("creationTimestamp")
    try:
        return now - datetime.fromisoformat(str(created).replace("Z", "+00:00"))
    except ValueError:
        return timedelta(0)
