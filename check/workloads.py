"""The checks of the inference workloads in scope: the sidecar in every inference pod, at the agent's version, budgets
that let drained pods be evicted, grace periods that hold the drain. Pure functions of a ``Snapshot``."""

from __future__ import annotations

from collections import defaultdict

from check import objects as o
from check.findings import Finding, Obj, Snapshot, error, listed, ok, warning
from check.installation import agent_daemonsets

_RESTARTABLE = ("Deployment", "StatefulSet", "DaemonSet")


def sidecar_pods(snapshot: Snapshot) -> list[Obj]:
    return [p for p in snapshot.pods if o.running(o.spec(p), "sidecar") is not None]


def _inference_without_sidecar(snapshot: Snapshot) -> list[Obj]:
    """Pods that ask for a GPU or for the sidecar (label ``spotdrain.io/inject=true``) and have none."""
    found = []
    for pod in snapshot.pods:
        wanted = o.labels(pod).get(o.INJECT_LABEL)
        if wanted == "false" or (o.owner(pod) or ("", ""))[0] == "DaemonSet":
            continue
        if (wanted == "true" or o.asks_for_gpu(pod)) and o.running(o.spec(pod), "sidecar") is None:
            found.append(pod)
    return found


def _restart(namespace: str, pods: list[Obj]) -> str:
    owners = sorted(
        {f"{kind.lower()}/{name}" for kind, name in filter(None, map(o.owner, pods)) if kind in _RESTARTABLE}
    )
    if owners:
        return f"kubectl -n {namespace} rollout restart {' '.join(owners)}"
    return f"delete and recreate the pods in {namespace} (kubectl -n {namespace} delete pod ...)"


def check_sidecar_injection(snapshot: Snapshot) -> list[Finding]:
    labelled = _labelled_namespaces(snapshot)
    by_namespace: dict[str, list[Obj]] = defaultdict(list)
    for pod in _inference_without_sidecar(snapshot):
        by_namespace[o.namespace(pod)].append(pod)
    findings = []
    for namespace, pods in sorted(by_namespace.items()):
        names = listed(sorted(o.name(p) for p in pods))
        refs = [o.ref("Pod", p) for p in pods]
        if namespace in labelled or all(o.labels(p).get(o.INJECT_LABEL) == "true" for p in pods):
            message = (
                f"{names} in {namespace} run without the sidecar although they ask for it: they were created while "
                "the webhook did not answer (failurePolicy: Ignore)"
            )
            fix = f"once the webhook answers (see webhook), {_restart(namespace, pods)}"
        else:
            message = (
                f"{names} in {namespace} ask for a GPU and run without the sidecar: "
                f"{namespace} is not labelled {o.INJECT_LABEL}=true"
            )
            fix = f"kubectl label namespace {namespace} {o.INJECT_LABEL}=true && {_restart(namespace, pods)}"
        findings.append(error("sidecar-injection", message, [f"Namespace/{namespace}", *refs], fix))
    findings += _sidecar_versions(snapshot)
    if not findings:
        count = len(sidecar_pods(snapshot))
        findings.append(ok("sidecar-injection", f"{count} inference pods have the sidecar, at the agent's version"))
    return findings


def _sidecar_versions(snapshot: Snapshot) -> list[Finding]:
    agents = [c for ds in agent_daemonsets(snapshot) if (c := o.running(o.template_spec(ds), "node"))]
    tags = {o.image_tag(str(c.get("image", ""))) for c in agents}
    if not tags:
        return []
    behind: dict[str, list[Obj]] = defaultdict(list)
    for pod in sidecar_pods(snapshot):
        sidecar = o.running(o.spec(pod), "sidecar") or {}
        tag = o.image_tag(str(sidecar.get("image", "")))
        if tag not in tags:
            behind[tag].append(pod)
    findings = []
    agent_tags = ", ".join(sorted(tags))
    for tag, pods in sorted(behind.items()):
        names = listed(sorted(o.ref("Pod", p) for p in pods))
        message = f"sidecar image {tag} in {names}, while the node agent runs {agent_tags}"
        fix = (
            f"set the sidecar image to the agent's version ({agent_tags}): the webhook's SPOTDRAIN_SIDECAR_IMAGE, or "
            "spotdrain inject --sidecar-image; then restart the workloads"
        )
        findings.append(warning("sidecar-injection", message, [o.ref("Pod", p) for p in pods], fix))
    return findings


def _awaiting_sidecar(snapshot: Snapshot) -> list[Obj]:
    """Inference pods that ask for the sidecar (their namespace or their own label) and were created without it."""
    labelled = _labelled_namespaces(snapshot)
    return [
        p
        for p in _inference_without_sidecar(snapshot)
        if o.namespace(p) in labelled or o.labels(p).get(o.INJECT_LABEL) == "true"
    ]


def _labelled_namespaces(snapshot: Snapshot) -> set[str]:
    return {o.name(ns) for ns in snapshot.namespaces if o.labels(ns).get(o.INJECT_LABEL) == "true"}


def check_budgets(snapshot: Snapshot) -> list[Finding]:
    """Budgets over pods with the sidecar, or over pods that will have it once they are recreated, need AlwaysAllow:
    the sidecar takes a draining pod out of rotation, and the API server evicts a pod that is not ready only then."""
    drained, awaiting = sidecar_pods(snapshot), _awaiting_sidecar(snapshot)
    findings, over = [], 0
    for budget in snapshot.budgets:
        selector = o.spec(budget).get("selector")
        covered = [
            [p for p in pods if o.namespace(p) == o.namespace(budget) and o.selector_matches(selector, o.labels(p))]
            for pods in (drained, awaiting)
        ]
        if not any(covered):
            continue
        over += 1
        if o.spec(budget).get(o.POLICY) == o.ALWAYS_ALLOW:
            continue
        message = (
            f"{o.ref('PodDisruptionBudget', budget)} covers {_covered(*covered)} and lacks "
            f"{o.POLICY}: {o.ALWAYS_ALLOW}: the API server refuses to evict the pods the sidecar took out of rotation"
        )
        patch = '{"spec":{"' + o.POLICY + '":"' + o.ALWAYS_ALLOW + '"}}'
        fix = f"kubectl -n {o.namespace(budget)} patch pdb {o.name(budget)} --type merge -p '{patch}'"
        findings.append(error("budgets", message, [o.ref("PodDisruptionBudget", budget)], fix))
    return findings or [ok("budgets", f"{over} budgets over pods with the sidecar let drained pods be evicted")]


def _covered(with_sidecar: list[Obj], awaiting: list[Obj]) -> str:
    parts = [f"{len(with_sidecar)} pods with the sidecar"] if with_sidecar else []
    if awaiting:
        parts.append(f"{len(awaiting)} pods that get the sidecar once recreated")
    return " and ".join(parts)


def check_grace_periods(snapshot: Snapshot) -> list[Finding]:
    short: dict[tuple[str, str, int, int], list[Obj]] = defaultdict(list)
    for pod in sidecar_pods(snapshot):
        sidecar = o.running(o.spec(pod), "sidecar") or {}
        drain_s = o.seconds(o.flag_value(sidecar, "--drain-timeout"), o.DEFAULT_DRAIN_TIMEOUT_S)
        needed = o.grace_needed(drain_s)
        grace = int(o.spec(pod).get("terminationGracePeriodSeconds", o.DEFAULT_GRACE_S))
        if grace < needed:
            kind, owner = o.owner(pod) or ("Pod", o.name(pod))
            short[(o.namespace(pod), f"{kind}/{owner}", grace, needed)].append(pod)
    findings = []
    for (namespace, owner, grace, needed), pods in sorted(short.items()):
        message = (
            f"{owner} in {namespace}: terminationGracePeriodSeconds {grace} is shorter than the sidecar's drain "
            f"({needed - o.GRACE_MARGIN_S} s) plus {o.GRACE_MARGIN_S} s: the kubelet kills the engine mid-drain"
        )
        kind = owner.partition("/")[0]
        patch = '{"spec":{"template":{"spec":{"terminationGracePeriodSeconds":' + str(needed) + "}}}}"
        fix = (
            f"kubectl -n {namespace} patch {owner.lower()} -p '{patch}'"
            if kind in _RESTARTABLE
            else f"set terminationGracePeriodSeconds: {needed} in the pod's manifest"
        )
        findings.append(error("grace-periods", message, [o.ref("Pod", p) for p in pods], fix))
    count = len(sidecar_pods(snapshot))
    return findings or [ok("grace-periods", f"{count} pods with the sidecar have the grace period their drain needs")]


def ready_endpoints(snapshot: Snapshot, namespace: str, service: str) -> int:
    """Endpoints of the Service that are ready (``conditions.ready`` unset reads as ready: discovery/v1 types.go)."""
    count = 0
    for slice_ in snapshot.slices:
        if o.namespace(slice_) == namespace and o.labels(slice_).get("kubernetes.io/service-name") == service:
            endpoints = [e for e in slice_.get("endpoints") or [] if isinstance(e, dict)]
            count += sum(1 for e in endpoints if (e.get("conditions") or {}).get("ready") is not False)
    return count


def check_gateway(snapshot: Snapshot) -> list[Finding]:
    gateways = [d for d in snapshot.deployments if o.running(o.template_spec(d), "gateway")]
    gateways = [g for g in gateways if snapshot.namespace in (None, o.namespace(g))]
    findings = []
    for gateway in gateways:
        namespace, pod_labels = o.namespace(gateway), o.template_labels(gateway)
        services = [
            s
            for s in snapshot.services
            if o.namespace(s) == namespace
            and (selector := o.spec(s).get("selector"))
            and all(pod_labels.get(k) == v for k, v in selector.items())
        ]
        refs = [o.ref("Deployment", gateway)]
        if not services:
            message = f"no Service selects the pods of {refs[0]}: clients cannot reach it"
            findings.append(warning("gateway", message, refs, "kubectl apply -k deploy/gateway"))
        for service in services:
            if ready_endpoints(snapshot, namespace, o.name(service)) == 0:
                message = f"{o.ref('Service', service)} selects no ready endpoint: every request to the gateway fails"
                fix = f"kubectl -n {namespace} describe deployment {o.name(gateway)}; kubectl -n {namespace} get pods"
                findings.append(error("gateway", message, [o.ref("Service", service), *refs], fix))
    if not gateways:
        return [ok("gateway", "no gateway installed (it is optional)")]
    return findings or [ok("gateway", f"{len(gateways)} gateways have ready endpoints")]
