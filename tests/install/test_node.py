"""The end-to-end tier's real nodes do what a user's cluster does for what the tier installs: the nodes register as
Karpenter registers them; a Deployment becomes Ready behind its readiness probe and is listed ready in its Service's
EndpointSlice; pods reach the API server through the ``kubernetes`` Service with their own ServiceAccount token (on
the pod network, with hostNetwork, on either node, with the Spot node's GPU requested), the instance's IMDS with
IMDSv2 from the host network only (the hop limit of 1) and each other across nodes; the API server reaches pods
behind their Services (its proxy, an admission webhook); an imported image runs unpulled; a mount under a
Bidirectional hostPath reaches the host. Stopping leaves nothing on the machine. Each phase's time is printed at the
end of the module."""

from __future__ import annotations

import base64
import json
import lzma
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from simulate.fakes.tls import write_tls_files
from tests.install import network, runtime
from tests.install.conftest import CLUSTER_TIMINGS, SPOT, STABLE
from tests.install.node import PYTHON_IMAGE, Cluster

TIMINGS: dict[str, float] = {}

# Run in the pods by the stand-in image's Python: what a user's client does with the mounted ServiceAccount.
WHO_AM_I = """
import json, os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
token = open(f"{sa}/token").read()
body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode()
request = urllib.request.Request(
    f"https://{host}:{port}/apis/authentication.k8s.io/v1/selfsubjectreviews",
    data=body, method="POST",
    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
context = ssl.create_default_context(cafile=f"{sa}/ca.crt")
with urllib.request.urlopen(request, timeout=10, context=context) as answer:
    print(json.dumps({"host": host, "user": json.load(answer)["status"]["userInfo"]["username"]}))
"""
IMDS_V2 = """
import json, urllib.error, urllib.request
base = "http://169.254.169.254/latest"
put = urllib.request.Request(f"{base}/api/token", method="PUT",
                             headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
token = urllib.request.urlopen(put, timeout=5).read().decode()
get = urllib.request.Request(f"{base}/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token})
instance = urllib.request.urlopen(get, timeout=5).read().decode()
try:
    v1 = urllib.request.urlopen(f"{base}/meta-data/instance-id", timeout=5).status
except urllib.error.HTTPError as refused:
    v1 = refused.code
print(json.dumps({"instance": instance, "without_token": v1}))
"""
IMDS_UNREACHABLE = """
import json, urllib.request
put = urllib.request.Request("http://169.254.169.254/latest/api/token", method="PUT",
                             headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
try:
    urllib.request.urlopen(put, timeout=3)
    print(json.dumps({"token": True}))
except OSError as error:
    print(json.dumps({"token": False, "error": type(error).__name__}))
"""
# An admission webhook as a user's would answer: AdmissionReview v1 in, the same uid out, over TLS.
HOOK = """
import http.server, json, ssl
class Hook(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        status = {"code": 403, "message": "refused by the e2e hook"}
        answer = {"uid": review["request"]["uid"], "allowed": False, "status": status}
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())
server = http.server.HTTPServer(("", 8443), Hook)
context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
context.load_cert_chain("/tls/server.crt", "/tls/server.key")
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""
FETCH = """
import json, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=10) as answer:
    print(json.dumps({"status": answer.status}))
"""


@pytest.fixture(scope="module")
def cluster(shared_cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The run's cluster (conftest.py), with a loop device of this module's: that the cluster's stop detaches it is
    checked when the run's cluster stops."""
    started = time.monotonic()
    TIMINGS.update(CLUSTER_TIMINGS)
    shared_cluster.attach_loop(64 << 20)
    try:
        yield shared_cluster
    finally:
        TIMINGS["module in all"] = time.monotonic() - started
        report(request.config)


def report(config: pytest.Config) -> None:
    """Print each phase's time past the output capture, as pytest's own live logging does."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        for name, seconds in TIMINGS.items():
            reporter.write_line(f"[e2e node] {name}: {seconds:.1f} s")


def on(node: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Pod spec fields that put a pod on ``node`` as a user's would: a nodeSelector on its capacity type, and on
    the Spot node a toleration of its GPU taint."""
    spec = SPOT if node == SPOT.name else STABLE
    fields: dict[str, Any] = {"nodeSelector": {"karpenter.sh/capacity-type": spec.labels["karpenter.sh/capacity-type"]}}
    if spec is SPOT:
        fields["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        # The node's startup taint stays until spotdrain's agent, installed after this module (test_install.py),
        # has built the model cache: these pods need no cache.
        fields["tolerations"].append({"key": "spotdrain.io/model-cache-pending", "operator": "Exists"})
    return {**fields, **(extra or {})}


def server(port: int) -> dict[str, Any]:
    return {
        "name": "web",
        "image": PYTHON_IMAGE,
        "command": ["python3", "-m", "http.server", str(port)],
        "readinessProbe": {"httpGet": {"path": "/", "port": port}, "periodSeconds": 1},
    }


def script_pod(name: str, node: str, script: str, *args: str, host_network: bool = False) -> dict[str, Any]:
    container = {"name": "run", "image": PYTHON_IMAGE, "command": ["python3", "-c", script, *args]}
    spec = on(node, {"restartPolicy": "Never", "containers": [container], "hostNetwork": host_network})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def apply(cluster: Cluster, *objects: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))


def finished(cluster: Cluster, name: str, phase_name: str) -> dict[str, Any]:
    """The JSON the pod ``name`` printed once it Succeeded; fails with its logs if it Failed."""
    started = time.monotonic()

    def done() -> dict[str, Any] | None:
        pod = cluster.get("pod", name)
        phase = pod["status"].get("phase")
        assert phase != "Failed", cluster.kubectl("logs", name, check=False)
        return pod if phase == "Succeeded" else None

    pod = cluster.wait_for(f"pod {name} Succeeded", done, within_s=60)
    TIMINGS[phase_name] = time.monotonic() - started
    assert pod["spec"]["nodeName"] in (SPOT.name, STABLE.name)
    printed: dict[str, Any] = json.loads(cluster.kubectl("logs", name).strip().splitlines()[-1])
    return {"node": pod["spec"]["nodeName"], "ip": pod["status"].get("podIP"), **printed}


def ready_pod(cluster: Cluster, selector: str) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pods: list[dict[str, Any]] = cluster.get("pods", "-l", selector)["items"]
        for pod in pods:
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
            if conditions.get("Ready") == "True":
                return pod
        return None

    found: dict[str, Any] = cluster.wait_for(f"a Ready pod of {selector}", ready, within_s=60)
    return found


def test_both_nodes_register_as_the_provisioner_made_them(cluster: Cluster) -> None:
    for spec in (SPOT, STABLE):
        node = cluster.get("node", spec.name)
        assert node["spec"]["providerID"] == spec.provider_id
        assert spec.labels.items() <= node["metadata"]["labels"].items()
        # the node lifecycle controller's own taints come and go with the Ready condition it last saw
        taints = [t for t in node["spec"].get("taints", []) if not t["key"].startswith("node.kubernetes.io/")]
        assert [f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in taints] == list(spec.taints)
        for name, value in spec.extended_resources.items():
            assert node["status"]["allocatable"][name] == value
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == cluster.node(spec.name).address


@pytest.fixture(scope="module")
def web(cluster: Cluster) -> dict[str, Any]:
    """A Deployment of ``python3 -m http.server`` behind a readiness probe on the Spot node, and its Service; its
    Ready pod."""
    started = time.monotonic()
    labels = {"app": "web"}
    template = {"metadata": {"labels": labels}, "spec": on(SPOT.name, {"containers": [server(8080)]})}
    spec = {"replicas": 1, "selector": {"matchLabels": labels}, "template": template}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}, "spec": spec}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}}
    service["spec"] = {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]}
    apply(cluster, deployment, service)
    pod = ready_pod(cluster, "app=web")
    TIMINGS["Deployment's pod Ready"] = time.monotonic() - started
    return pod


def test_a_deployment_becomes_ready_on_the_spot_node_and_its_slice_lists_it(
    cluster: Cluster, web: dict[str, Any]
) -> None:
    assert web["spec"]["nodeName"] == SPOT.name
    assert web["status"]["podIP"].startswith("10.214.0.")

    def listed() -> list[dict[str, Any]]:
        slices = cluster.get("endpointslices", "-l", "kubernetes.io/service-name=web")["items"]
        return [e for s in slices for e in s.get("endpoints") or [] if e["addresses"] == [web["status"]["podIP"]]]

    endpoints = cluster.wait_for("the pod in the Service's EndpointSlice", listed, within_s=30)
    assert endpoints[0]["conditions"]["ready"] is True
    assert endpoints[0]["nodeName"] == SPOT.name


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service_with_its_token(cluster: Cluster) -> None:
    pod = script_pod("who-am-i", SPOT.name, WHO_AM_I)
    gpu = {"nvidia.com/gpu": "1"}  # as an inference pod asks for the node's GPU
    pod["spec"]["containers"][0]["resources"] = {"requests": gpu, "limits": gpu}
    apply(cluster, pod)
    printed = finished(cluster, "who-am-i", "pod ran and reached the API server")
    assert printed["host"] == network.KUBERNETES_SERVICE
    assert printed["user"] == "system:serviceaccount:default:default"
    assert printed["ip"].startswith("10.214.0.")


def test_a_host_network_pod_reaches_the_nodes_imds_with_a_token_and_a_pod_on_the_pod_network_does_not(
    cluster: Cluster,
) -> None:
    """As with the shipped EC2NodeClass's hop limit of 1: the agent's pods (hostNetwork) use IMDS, others cannot."""
    apply(
        cluster,
        script_pod("imds", SPOT.name, IMDS_V2, host_network=True),
        script_pod("imds-unreachable", SPOT.name, IMDS_UNREACHABLE),
    )
    printed = finished(cluster, "imds", "hostNetwork pod ran and reached IMDS")
    assert printed["instance"] == SPOT.provider_id.rpartition("/")[2]
    assert printed["without_token"] == 401
    unreached = finished(cluster, "imds-unreachable", "pod on the pod network ran and did not reach IMDS")
    assert unreached["token"] is False, unreached


def test_a_host_network_pod_runs_on_the_nodes_address_and_reaches_the_api_server(cluster: Cluster) -> None:
    apply(cluster, script_pod("host-who-am-i", SPOT.name, WHO_AM_I, host_network=True))
    printed = finished(cluster, "host-who-am-i", "hostNetwork pod ran")
    assert printed["ip"] == cluster.node(SPOT.name).address
    assert printed["user"] == "system:serviceaccount:default:default"


def test_the_stable_node_runs_pods_that_reach_the_api_server(cluster: Cluster) -> None:
    apply(cluster, script_pod("stable-who-am-i", STABLE.name, WHO_AM_I))
    printed = finished(cluster, "stable-who-am-i", "pod on the stable node ran")
    assert printed["node"] == STABLE.name
    assert printed["ip"].startswith("10.214.1.")
    assert printed["user"] == "system:serviceaccount:default:default"


def test_a_pod_on_the_stable_node_reaches_a_pod_on_the_spot_node(cluster: Cluster, web: dict[str, Any]) -> None:
    if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() != "1":
        pytest.skip("pods on two nodes reach each other through the host's forwarding, which is off here")
    apply(cluster, script_pod("across", STABLE.name, FETCH, f"http://{web['status']['podIP']}:8080/"))
    printed = finished(cluster, "across", "pod across nodes ran")
    assert printed["node"] == STABLE.name
    assert printed["status"] == 200


def test_an_imported_image_reaches_every_node_and_runs_without_a_pull(cluster: Cluster, tmp_path: Path) -> None:
    tag = f"localhost/spotdrain-e2e/imported:{uuid.uuid4().hex[:12]}"  # in no node's containerd yet
    archive = runtime.busybox_archive(tmp_path / "imported.tar", tag, ["/bin/busybox", "echo"])
    packed = tmp_path / "imported.tar.xz"
    packed.write_bytes(lzma.compress(archive.read_bytes()))  # as podman save | xz gives it
    started = time.monotonic()
    cluster.import_image(packed)
    TIMINGS["image imported into both nodes"] = time.monotonic() - started
    for node in cluster.nodes:
        assert tag in runtime.image_names(node.socket)
    pod = script_pod("imported", STABLE.name, "")
    pod["spec"]["containers"][0] |= {"image": tag, "command": None, "args": ["{}"], "imagePullPolicy": "Never"}
    apply(cluster, pod)
    assert finished(cluster, "imported", "pod of the imported image ran")["node"] == STABLE.name


def test_a_mount_made_under_a_bidirectional_host_path_reaches_the_host(cluster: Cluster) -> None:
    shared = cluster.share(Path("/mnt/spotdrain-e2e-model-cache"))  # as the agent's /mnt/model-cache
    mounting = "mkdir -p /cache/inner && mount -t tmpfs -o size=1m e2e-cache /cache/inner"
    mounting += " && echo written > /cache/inner/file && echo '{}'"
    pod = script_pod("bidirectional", SPOT.name, "")
    pod["spec"]["containers"][0] |= {
        "command": ["sh", "-c", mounting],
        "securityContext": {"privileged": True},  # the API server refuses Bidirectional otherwise
        "volumeMounts": [{"name": "cache", "mountPath": "/cache", "mountPropagation": "Bidirectional"}],
    }
    pod["spec"]["volumes"] = [{"name": "cache", "hostPath": {"path": str(shared), "type": "Directory"}}]
    apply(cluster, pod)
    finished(cluster, "bidirectional", "pod mounted under a Bidirectional hostPath")
    found = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE,SOURCE", str(shared / "inner")], capture_output=True, text=True, timeout=30
    )
    assert found.stdout.split() == ["tmpfs", "e2e-cache"]
    assert (shared / "inner" / "file").read_text() == "written\n"


def test_the_api_server_reaches_a_pod_behind_its_service(cluster: Cluster, web: dict[str, Any]) -> None:
    listing = cluster.kubectl("get", "--raw", "/api/v1/namespaces/default/services/web/proxy/")
    assert "Directory listing for /" in listing


def test_the_api_server_calls_an_admission_webhook_behind_its_service(cluster: Cluster, tmp_path: Path) -> None:
    tls = write_tls_files(tmp_path, hosts=("hook.default.svc",))
    files = {"server.crt": tls.cert_path.read_text(), "server.key": tls.key_path.read_text()}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hook-tls"}, "stringData": files}
    container: dict[str, Any] = {
        "name": "hook",
        "image": PYTHON_IMAGE,
        "command": ["python3", "-c", HOOK],
        "volumeMounts": [{"name": "tls", "mountPath": "/tls"}],
        "readinessProbe": {"tcpSocket": {"port": 8443}, "periodSeconds": 1},
    }
    volumes = [{"name": "tls", "secret": {"secretName": "hook-tls"}}]
    spec = on(STABLE.name, {"containers": [container], "volumes": volumes})
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "hook", "labels": {"app": "hook"}}, "spec": spec}
    ports = [{"port": 443, "targetPort": 8443}]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hook"}}
    service["spec"] = {"selector": {"app": "hook"}, "ports": ports}
    started = time.monotonic()
    apply(cluster, secret, pod, service)
    ready_pod(cluster, "app=hook")
    TIMINGS["webhook pod Ready"] = time.monotonic() - started
    hook: dict[str, Any] = {
        "name": "refuse.e2e.spotdrain.io",
        "clientConfig": {
            "service": {"namespace": "default", "name": "hook", "port": 443, "path": "/validate"},
            "caBundle": base64.b64encode(tls.ca_path.read_bytes()).decode(),
        },
        "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]}],
        "objectSelector": {"matchLabels": {"e2e-hook": "refuse"}},
        "failurePolicy": "Fail",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 5,
    }
    kind = {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration"}
    apply(cluster, {**kind, "metadata": {"name": "e2e-refuse"}, "webhooks": [hook]})
    refused = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "refused", "labels": {"e2e-hook": "refuse"}},
    }

    def answered() -> str:
        try:
            cluster.kubectl("create", "-f", "-", input=json.dumps(refused))
        except AssertionError as refusal:
            return str(refusal)
        cluster.kubectl("delete", "configmap", "refused")  # made before the API server saw the configuration
        return ""

    try:
        assert "refused by the e2e hook" in cluster.wait_for("the webhook's answer", answered, within_s=30)
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", "e2e-refuse")
