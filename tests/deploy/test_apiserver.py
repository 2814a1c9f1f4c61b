"""Every rendering a user may install is accepted by the real kube-apiserver: each object is sent to it as a
server-side dry-run create, after the CRDs its custom kinds need and the namespaces it goes in. The API server
validates what schemas do not express (the 15-character limit of a port name, the CEL of a
ValidatingAdmissionPolicy, a webhook's client configuration) and runs its admission plugins; a refusal, or a warning
kubectl would print, fails the rendering with the API server's message."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.apiserver import DryRunServer
from tests.deploy.manifests import CRDS, Obj, one, render, renderings

PREFETCH = "daemonset/imds-mode+deploy/components/model-prefetch"


@pytest.mark.parametrize("rendering", renderings())
def test_the_api_server_accepts_every_object_of_the_rendering(rendering: str, dry_run_server: DryRunServer) -> None:
    answer = dry_run_server.submit(render(rendering))
    refused, warned = "\n".join(answer.refused), "\n".join(answer.warnings)
    assert not answer.refused, f"the API server refuses objects of {rendering}:\n{refused}"
    # kubectl prints these to the user who applies the rendering: a deprecated field, a PodSecurity violation of
    # the pods a workload would make.
    assert not answer.warnings, f"the API server warns of objects of {rendering}:\n{warned}"
    if answer.unchecked:
        pytest.skip(f"no CRD in {CRDS} for {', '.join(answer.unchecked)}: not sent to the API server")


def _container(daemonset: Obj, name: str) -> Obj:
    found: Obj = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == name)
    return found


def test_a_port_name_longer_than_15_characters_is_refused(dry_run_server: DryRunServer) -> None:
    daemonset = copy.deepcopy(one(render(PREFETCH), "DaemonSet", "spotdrain-node"))
    prefetch = _container(daemonset, "model-prefetch")
    prefetch["ports"][0]["name"] = prefetch["livenessProbe"]["httpGet"]["port"] = "prefetch-metrics"
    (refused,) = dry_run_server.submit([daemonset]).refused
    assert refused.startswith("DaemonSet spotdrain/spotdrain-node: 422 Invalid:")
    assert 'ports[0].name: Invalid value: "prefetch-metrics": must be no more than 15 characters' in refused


def test_an_unknown_field_is_refused_as_kubectl_apply_refuses_it(dry_run_server: DryRunServer) -> None:
    daemonset = copy.deepcopy(one(render(PREFETCH), "DaemonSet", "spotdrain-node"))
    daemonset["spec"]["template"]["spec"]["terminationGracePeriod"] = 30
    (refused,) = dry_run_server.submit([daemonset]).refused
    assert 'unknown field "spec.template.spec.terminationGracePeriod"' in refused


def test_a_namespace_an_earlier_rendering_made_is_still_checked(dry_run_server: DryRunServer) -> None:
    namespace = copy.deepcopy(one(render("daemonset/imds-mode"), "Namespace", "spotdrain"))
    assert dry_run_server.submit([namespace]).refused == []
    namespace["metadata"].setdefault("labels", {})["spotdrain.io/inject"] = "not a label value"
    (refused,) = dry_run_server.submit([namespace]).refused
    assert refused.startswith("Namespace spotdrain: 422 Invalid:")


def test_a_dashboard_too_big_for_kubectl_apply_is_refused(dry_run_server: DryRunServer) -> None:
    # Its data alone fits a ConfigMap (1 MiB), but kubectl apply copies it into an annotation (256 KiB at most).
    dashboard = copy.deepcopy(
        one(render("daemonset/imds-mode+deploy/components/grafana"), "ConfigMap", "spotdrain-dashboard")
    )
    (key,) = dashboard["data"]
    dashboard["data"][key] += " " * 300_000
    (refused,) = dry_run_server.submit([dashboard]).refused
    assert "metadata.annotations: Too long: may not be more than 262144 bytes" in refused


def test_a_warning_kubectl_would_print_is_reported(dry_run_server: DryRunServer) -> None:
    daemonset = copy.deepcopy(one(render(PREFETCH), "DaemonSet", "spotdrain-node"))
    # Deprecated since 1.14: accepted with a warning (pkg/api/pod/warnings.go, GetWarningsForPodTemplate).
    daemonset["spec"]["template"]["spec"]["nodeSelector"] = {"beta.kubernetes.io/arch": "amd64"}
    answer = dry_run_server.submit([daemonset])
    assert answer.refused == []
    assert answer.warnings == [
        "DaemonSet spotdrain/spotdrain-node: spec.template.spec.nodeSelector[beta.kubernetes.io/arch]: deprecated"
        ' since v1.14; use "kubernetes.io/arch" instead'
    ]
