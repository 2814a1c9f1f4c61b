"""deploy/webhook against the code: the configuration sends exactly the Pods the webhook would inject, to the
Service, port and path it serves; each certificate mode wires the certificate where the flags say; the
self-managed RBAC grants exactly the calls it makes, on its one Secret and one configuration."""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from simulate.fakes.kube import FakeKube
from simulate.fakes.kube_resources import MUTATING_WEBHOOKS, VALIDATING_WEBHOOKS
from spotdrain.metrics import CollectorRegistry
from tests.deploy.manifests import (
    DEPLOY,
    Obj,
    grants,
    invocations,
    named,
    needed,
    one,
    parse,
    pod_templates,
    render,
    schema_errors,
    selects,
)
from webhook.admission import LABEL, wants_sidecar
from webhook.metrics import WebhookMetrics
from webhook.selfmanaged import provision
from webhook.server import webhook_app
from webhook.settings import WebhookSettings

MODES = ("deploy/webhook/self-managed", "deploy/webhook/cert-manager")
NAMESPACE, ACCOUNT = "spotdrain", "spotdrain-webhook"
METRICS = WebhookMetrics.create(CollectorRegistry())
GUARD_GRANT = ("", "pods", "get", None)  # the eviction guard reads the pod an eviction names (deploy/webhook/base)


def _settings(objects: list[Obj], monkeypatch: pytest.MonkeyPatch, capsys: Any) -> WebhookSettings:
    [call] = [c for c in invocations(objects) if c.subcommand == "webhook"]
    settings: WebhookSettings = parse(call, monkeypatch, capsys)
    return settings


def _configuration(objects: list[Obj]) -> Obj:
    return one(objects, "MutatingWebhookConfiguration", "spotdrain-webhook")


def _template(objects: list[Obj]) -> Any:
    return next(t for t in pod_templates(objects) if t.owner["metadata"]["name"] == "spotdrain-webhook")


@pytest.mark.parametrize("directory", MODES)
def test_every_webhook_fails_open_has_no_side_effects_and_answers_quickly(directory: str) -> None:
    for hook in _configuration(render(directory))["webhooks"]:
        assert hook["failurePolicy"] == "Ignore"
        assert hook["sideEffects"] == "None"
        assert hook["timeoutSeconds"] <= 5
        assert hook["admissionReviewVersions"] == ["v1"]
        assert hook["rules"] == [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ]


@pytest.mark.parametrize("directory", MODES)
def test_the_configuration_calls_the_service_port_and_path_the_webhook_serves(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    settings = _settings(objects, monkeypatch, capsys)
    routes = {
        (r.method, r.resource.canonical)
        for r in webhook_app(settings.inject, metrics=METRICS, max_body_bytes=1, read_timeout_s=1).router.routes()
        if r.resource
    }
    for hook in _configuration(objects)["webhooks"]:
        service = hook["clientConfig"]["service"]
        found = one(objects, "Service", service["name"])
        assert found["metadata"]["namespace"] == service["namespace"]
        [port] = [p for p in found["spec"]["ports"] if p["port"] == service["port"]]
        container = _template(objects).container("webhook")
        assert {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]] == settings.port
        assert ("POST", service["path"]) in routes
    for probe in ("readinessProbe", "livenessProbe"):
        check = container[probe]["httpGet"]
        assert (check["scheme"], check["path"], check["port"]) == ("HTTPS", "/healthz", port["targetPort"])
        assert ("GET", "/healthz") in routes


@pytest.mark.parametrize("directory", MODES)
def test_the_configuration_sends_each_pod_once_exactly_when_the_webhook_would_inject_it(directory: str) -> None:
    hooks = _configuration(render(directory))["webhooks"]
    values = (None, "true", "false")
    for namespace_label, pod_label in itertools.product(values, values):
        namespace = {"kubernetes.io/metadata.name": "inference"} | ({LABEL: namespace_label} if namespace_label else {})
        pod = {LABEL: pod_label} if pod_label else {}
        sent = [h for h in hooks if selects(h["namespaceSelector"], namespace) and selects(h["objectSelector"], pod)]
        asked = pod_label == "true" or (namespace_label == "true" and pod_label != "false")
        assert len(sent) == int(asked), (namespace_label, pod_label)
        if sent:  # and the server, seeing only the Pod, agrees
            assert wants_sidecar({"metadata": {"labels": pod}})


@pytest.mark.parametrize("directory", MODES)
def test_two_replicas_run_on_on_demand_nodes_unprivileged_with_a_budget_that_lets_them_go(directory: str) -> None:
    objects = render(directory)
    deployment = one(objects, "Deployment", "spotdrain-webhook")
    assert deployment["spec"]["replicas"] == 2
    spec = deployment["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["on-demand"]} in [
        e for term in terms for e in term["matchExpressions"]
    ]
    assert all(selects(term, {"karpenter.sh/capacity-type": "spot"}) is False for term in terms)
    context = spec["containers"][0]["securityContext"]
    assert spec["securityContext"]["runAsNonRoot"]
    assert spec["securityContext"]["runAsUser"] == 65532
    assert context["readOnlyRootFilesystem"]
    assert not context["allowPrivilegeEscalation"]
    assert context["capabilities"]["drop"] == ["ALL"]
    budget = one(objects, "PodDisruptionBudget", "spotdrain-webhook")
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert budget["spec"]["minAvailable"] == 1


@pytest.mark.parametrize("directory", MODES)
def test_the_certificate_files_are_on_the_volume_each_mode_fills(
    directory: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render(directory)
    settings = _settings(objects, monkeypatch, capsys)
    template = _template(objects)
    [mount] = [m for m in template.container("webhook")["volumeMounts"] if m["name"] == "tls"]
    assert settings.tls.cert.parent == settings.tls.key.parent == Path(mount["mountPath"])
    volume = template.volume("tls")
    if settings.tls.self_managed:
        assert "emptyDir" in volume  # the webhook writes them there
        assert not mount.get("readOnly")
    else:
        certificate = one(objects, "Certificate", "spotdrain-webhook")
        assert volume == {
            "name": "tls",
            "secret": {"secretName": certificate["spec"]["secretName"], "defaultMode": 0o440},
        }
        assert (settings.tls.cert.name, settings.tls.key.name) == ("tls.crt", "tls.key")  # what cert-manager writes
    assert template.spec["automountServiceAccountToken"] is True  # the eviction guard reads pods


def test_cert_manager_signs_for_the_service_with_the_ca_the_configuration_trusts() -> None:
    objects = render("deploy/webhook/cert-manager")
    serving = one(objects, "Certificate", "spotdrain-webhook")
    service = one(objects, "Service", "spotdrain-webhook")
    assert f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc" in serving["spec"]["dnsNames"]
    # The serving certificate's issuer signs with the CA Certificate's Secret, and that CA is what is injected, so
    # renewing the serving certificate leaves the caBundle as it was.
    ca_issuer = one(objects, "Issuer", serving["spec"]["issuerRef"]["name"])
    ca = next(
        c for c in named(objects, "Certificate") if c["spec"]["secretName"] == ca_issuer["spec"]["ca"]["secretName"]
    )
    assert ca["spec"]["isCA"] is True
    annotation = _configuration(objects)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert annotation == f"{ca['metadata']['namespace']}/{ca['metadata']['name']}"
    assert one(objects, "Issuer", ca["spec"]["issuerRef"]["name"])["spec"] == {"selfSigned": {}}
    for certificate in (serving, ca):
        issuer = one(objects, "Issuer", certificate["spec"]["issuerRef"]["name"])
        assert issuer["metadata"]["namespace"] == certificate["metadata"]["namespace"]
        assert certificate["spec"]["issuerRef"]["kind"] == "Issuer"
        # The fields used, as cert-manager's v1 API defines them (cert-manager.io_certificates.yaml).
        fields = {"secretName", "dnsNames", "issuerRef", "duration", "renewBefore", "privateKey", "isCA", "commonName"}
        assert set(certificate["spec"]) <= fields
        assert set(certificate["spec"]["privateKey"]) <= {"algorithm", "size", "rotationPolicy"}
    # With cert-manager the webhook calls the API only to read the pod an agent's eviction names (the guard).
    assert grants(objects, NAMESPACE, ACCOUNT) == {GUARD_GRANT}


def test_only_the_self_managed_mode_may_touch_its_secret_and_configuration_by_name(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render("deploy/webhook/self-managed")
    settings = _settings(objects, monkeypatch, capsys)
    assert settings.tls.self_managed
    assert (settings.tls.namespace, settings.tls.service) == ("inference", "spotdrain-webhook")  # POD_NAMESPACE
    for role in named(objects, "Role") + named(objects, "ClusterRole"):
        for rule in role["rules"]:
            # create cannot be limited by name (the authorizer has none yet), nor can the guard's reads of pods
            if rule["verbs"] != ["create"] and rule["resources"] != ["pods"]:
                assert rule["resourceNames"] in ([settings.tls.secret], [settings.tls.configuration]), rule
    assert _configuration(objects)["metadata"]["name"] == settings.tls.configuration


async def test_the_self_managed_rbac_grants_exactly_the_calls_it_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    objects = render("deploy/webhook/self-managed")
    granted = grants(objects, NAMESPACE, ACCOUNT)
    # The manifest's settings, in the namespace it is installed in, writing its files here.
    parsed = _settings(objects, monkeypatch, capsys).tls
    tls = dataclasses.replace(parsed, cert=tmp_path / "tls.crt", key=tmp_path / "tls.key", namespace=NAMESPACE)
    async with FakeKube() as kube:
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        kube.store.create(MUTATING_WEBHOOKS, None, _configuration(objects))
        kube.store.create(
            VALIDATING_WEBHOOKS, None, one(objects, "ValidatingWebhookConfiguration", "spotdrain-webhook")
        )
        await provision(tls, serviceaccount_dir=kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE))
        assert needed(kube.calls, granted) == granted - {GUARD_GRANT}  # the guard reads pods when asked, not here


def test_the_monitoring_component_scrapes_the_plain_http_port_that_serves_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    # A user's overlay, as the component's comment tells one to write (kustomize wants relative paths).
    webhook = os.path.relpath(DEPLOY / "webhook", tmp_path)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"{webhook}/self-managed"],
        "components": [f"{webhook}/components/monitoring"],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    objects = render(str(tmp_path))
    monitor = one(objects, "PodMonitor", "spotdrain-webhook")
    assert schema_errors(monitor) == []
    settings = _settings(objects, monkeypatch, capsys)
    template = _template(objects)
    assert monitor["metadata"]["namespace"] == one(objects, "Deployment", "spotdrain-webhook")["metadata"]["namespace"]
    assert selects(monitor["spec"]["selector"], template.labels)
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in template.container("webhook")["ports"]}
    assert (endpoint["path"], ports[endpoint["port"]]) == ("/metrics", settings.metrics_port)
    assert "scheme" not in endpoint, "plain HTTP: Prometheus needs no CA"
