"""The check of the admission webhook: installed where namespaces ask for the sidecar, trusted by the API server, and
answering. Pure function of a ``Snapshot``."""

from __future__ import annotations

from check import objects as o
from check.findings import Finding, Obj, Snapshot, error, ok, warning
from check.workloads import ready_endpoints


def spotdrain_webhooks(snapshot: Snapshot) -> list[Obj]:
    """The MutatingWebhookConfigurations whose webhooks are spotdrain's (``*.spotdrain.io``)."""
    return [
        config
        for config in snapshot.webhooks
        if any(str(w.get("name", "")).endswith("spotdrain.io") for w in config.get("webhooks") or [])
    ]


def check_webhook(snapshot: Snapshot) -> list[Finding]:
    configs = spotdrain_webhooks(snapshot)
    labelled = [
        o.name(ns)
        for ns in snapshot.namespaces
        if o.labels(ns).get(o.INJECT_LABEL) == "true" and snapshot.namespace in (None, o.name(ns))
    ]
    if not configs:
        if labelled:
            message = f"namespaces {', '.join(labelled)} are labelled {o.INJECT_LABEL}=true but no webhook is installed"
            refs = [f"Namespace/{n}" for n in labelled]
            return [error("webhook", message, refs, "kubectl apply -k deploy/webhook/self-managed")]
        return [ok("webhook", "no webhook installed (spotdrain inject writes the sidecar into manifests instead)")]
    findings = [f for config in configs for f in _config_findings(snapshot, config)]
    return findings or [
        ok(
            "webhook",
            "the webhook is trusted and answering",
            *[o.ref("MutatingWebhookConfiguration", c) for c in configs],
        )
    ]


def _config_findings(snapshot: Snapshot, config: Obj) -> list[Finding]:
    ref = o.ref("MutatingWebhookConfiguration", config)
    hooks = [w for w in config.get("webhooks") or [] if isinstance(w, dict)]
    findings = []
    if any(not (w.get("clientConfig") or {}).get("caBundle") for w in hooks):
        message = f"{ref} has no caBundle: the API server cannot trust the webhook, so no pod gets the sidecar"
        fix = (
            "kubectl -n spotdrain logs deploy/spotdrain-webhook (self-managed writes the caBundle at start; "
            "with cert-manager, check its CA injector)"
        )
        findings.append(error("webhook", message, [ref], fix))
    services = {
        (str(s.get("namespace", "")), str(s.get("name", "")))
        for w in hooks
        if isinstance(s := (w.get("clientConfig") or {}).get("service"), dict)
    }
    ignore = any(w.get("failurePolicy", "Fail") == "Ignore" for w in hooks)
    for namespace, name in sorted(services):
        if ready_endpoints(snapshot, namespace, name) == 0:
            effect = "pods are created without the sidecar (failurePolicy: Ignore)" if ignore else "pod creation fails"
            message = f"the webhook's Service {namespace}/{name} has no ready endpoint: {effect}"
            fix = f"kubectl -n {namespace} get endpointslices -l kubernetes.io/service-name={name}; " + (
                f"kubectl -n {namespace} logs deploy/{name}"
            )
            findings.append(error("webhook", message, [ref, f"Service/{namespace}/{name}"], fix))
    if not ignore and not findings:
        message = f"{ref} has failurePolicy: Fail: while the webhook is down, no pod is created in labelled namespaces"
        findings.append(warning("webhook", message, [ref], "keep failurePolicy: Ignore, as deploy/webhook ships it"))
    return findings
