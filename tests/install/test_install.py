"""spotdrain installed on the real nodes exactly as README.md's "Install" and "Model cache" tell a user (the images
built from the Dockerfiles, each step a ``kubectl apply -k`` of the shipped directory through an overlay that sets
only ``images:`` and what the docs say to set: ``installing.py``), and what a user looks at then: the agent's init
container makes the cache on the node's disk and lifts the node's startup taint; the webhook gives pods the
sidecar; the model uploaded to S3 is fetched onto the cache by the prefetch (with the instance role's credentials
from IMDS) and by the pod's init container, and the engine pod becomes Ready with it; ``spotdrain
check`` finds nothing wrong, and finds each piece broken on purpose. What the install saw is printed as a timeline."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from simulate.model import tiny_checkpoint
from tests.install import installing, reset
from tests.install.conftest import NODE_ROLE, SPOT, STABLE
from tests.install.engine import ROOT, tag_of
from tests.install.node import Cluster
from tests.install.reset import imds

READY_WITHIN_S = 240.0
STARTUP_TAINT = "spotdrain.io/model-cache-pending"
CACHE = installing.CACHE


def ready_pods(cluster: Cluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    return [pod for pod in reset.pods(cluster, namespace, selector) if reset.ready(pod)]


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == kind), {})


def wait_ready(installed: installing.Installed, namespace: str, selector: str, what: str) -> dict[str, Any]:
    cluster = installed.cluster

    def found() -> dict[str, Any] | None:
        pods = ready_pods(cluster, namespace, selector)
        return pods[0] if pods else None

    try:
        pod: dict[str, Any] = cluster.wait_for(what, found, within_s=READY_WITHIN_S)
    except TimeoutError:
        pods = cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False)
        described = cluster.kubectl("describe", "pods", "-n", namespace, "-l", selector, check=False)
        raise AssertionError(f"{what} not within {READY_WITHIN_S} s\n{pods}\n{described[-6000:]}") from None
    installed.timeline.note(what)
    return pod


def findings(cluster: Cluster) -> list[dict[str, Any]]:
    """``spotdrain check --output json`` run from the host with the administrator's kubeconfig, on the install's
    namespace as docs/check.md shows (the agents are always checked): the cluster also holds test_node.py's pods,
    among them a GPU pod without the sidecar in ``default``, which the check rightly reports."""
    argv = [sys.executable, "-m", "spotdrain.cli", "check", "--output", "json", "--namespace", "inference"]
    argv += ["--kubeconfig", str(cluster.kubeconfig)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode in (0, 1), f"spotdrain check could not read the cluster: {done.stdout}{done.stderr}"
    found: list[dict[str, Any]] = json.loads(done.stdout)
    errors = [f for f in found if f["severity"] == "error"]
    assert (done.returncode == 1) == bool(errors), done.stdout
    return found


def errors(found: list[dict[str, Any]]) -> list[str]:
    return [f"{f['check']}: {f['message']} {f['objects']}" for f in found if f["severity"] == "error"]


def test_the_agents_init_container_makes_the_cache_on_the_disk_and_lifts_the_startup_taint(
    installed: installing.Installed,
) -> None:
    cluster = installed.cluster

    def untainted() -> dict[str, Any] | None:
        node = cluster.get("node", SPOT.name)
        return None if any(t["key"] == STARTUP_TAINT for t in node["spec"].get("taints", [])) else node

    try:
        node = cluster.wait_for("the startup taint lifted", untainted, within_s=READY_WITHIN_S)
    except TimeoutError:
        logs = cluster.kubectl("logs", "-n", "spotdrain", "daemonset/spotdrain-node", "-c", "model-cache", check=False)
        described = cluster.kubectl("describe", "pods", "-n", "spotdrain", check=False)
        raise AssertionError(f"the startup taint stayed\n{logs[-4000:]}\n{described[-6000:]}") from None
    installed.timeline.note(f"{STARTUP_TAINT} taint lifted")
    assert node["metadata"]["labels"]["spotdrain.io/model-cache"] == "ready"
    # the share's bind of the host directory, and over it (the last line) the cache the init container mounted
    mounts = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE,FSTYPE", str(CACHE)], capture_output=True, text=True, timeout=30
    ).stdout.splitlines()
    mounted = mounts[-1].split() if mounts else []
    assert mounted == [installed.device, "xfs"], f"{CACHE}: {mounted}"
    pod = wait_ready(installed, "spotdrain", "app.kubernetes.io/name=spotdrain-node", "agent pod Ready")
    assert pod["spec"]["nodeName"] == SPOT.name
    init = pod["status"]["initContainerStatuses"][0]
    assert init["name"] == "model-cache"
    assert init["state"]["terminated"]["exitCode"] == 0
    assert not cluster.get(
        "pods",
        "-n",
        "spotdrain",
        "-l",
        "app.kubernetes.io/name=spotdrain-node",
        "--field-selector",
        f"spec.nodeName={STABLE.name}",
    )["items"], "an agent on a non-GPU node"


def test_the_webhook_gives_a_gpu_pod_in_the_labelled_namespace_the_sidecar(installed: installing.Installed) -> None:
    cluster = installed.cluster
    hook = wait_ready(installed, "spotdrain", "app.kubernetes.io/name=spotdrain-webhook", "a webhook replica Ready")
    assert hook["spec"]["nodeName"] == STABLE.name

    def injected() -> dict[str, Any] | None:
        # server-side dry run: the API server calls the admission webhooks, and stores nothing
        made = json.loads(
            cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(USERS_ENGINE))
        )
        names = {c["name"]: c for c in made["spec"]["containers"]}
        return names if "spotdrain" in names else None

    # the API server reaches the webhook once its endpoint is listed and the caBundle written
    containers = cluster.wait_for("the sidecar injected", injected, within_s=60)
    installed.timeline.note("the webhook injected the sidecar into a pod")
    assert containers["spotdrain"]["image"] == tag_of("sidecar")
    assert containers["spotdrain"]["command"][:2] == ["spotdrain", "sidecar"]


def test_the_model_is_fetched_onto_the_cache_and_the_engine_pod_becomes_ready_behind_the_sidecar(
    installed: installing.Installed,
) -> None:
    cluster = installed.cluster
    pod = wait_ready(installed, "inference", "app.kubernetes.io/name=vllm", "vllm pod Ready")
    assert pod["spec"]["nodeName"] == SPOT.name
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert containers["spotdrain"]["image"] == tag_of("sidecar")
    # Ready only through the readiness gate the sidecar sets over the API
    assert _condition(pod, "spotdrain.io/serving")["status"] == "True"
    fetch = pod["status"]["initContainerStatuses"][0]
    assert fetch["name"] == "model-fetch"
    assert fetch["state"]["terminated"]["exitCode"] == 0
    fetched = CACHE / "models" / installing.MODEL
    assert {p.name for p in fetched.iterdir() if p.is_file()} >= set(tiny_checkpoint())
    for name, data in tiny_checkpoint().items():
        assert (fetched / name).read_bytes() == data, name
    proxy = f"/api/v1/namespaces/inference/pods/{pod['metadata']['name']}:8000/proxy"
    request = {"model": "Qwen/Qwen2.5-7B-Instruct", "prompt": "Hello", "max_tokens": 8, "stream": True}
    # kubectl create --raw POSTs the file it is given; the answer comes back whole once the stream ends
    streamed = cluster.kubectl("create", "--raw", f"{proxy}/v1/completions", "-f", "-", input=json.dumps(request))
    chunks = [line.removeprefix("data: ") for line in streamed.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]", streamed
    assert len(chunks) > 2, streamed
    assert "vllm:num_requests_running" in cluster.kubectl("get", "--raw", f"{proxy}/metrics")
    installed.timeline.note("a completion streamed from the engine through the API server's proxy")


def test_the_prefetch_fetches_the_nodes_models_with_the_instance_roles_credentials(
    installed: installing.Installed,
) -> None:
    """deploy/components/model-prefetch fetches every model the node's ``spotdrain.io/models`` annotation (the
    NodePool's) names and labels the node for each; it has no key: it signs with the instance role's credentials,
    which it reads from the node's IMDS on the host network. The pod's own model it may find already fetched by the
    pod's init container (they start together); the Ray workers' model no pod here asks for, so the prefetch fetches
    it from S3."""
    cluster = installed.cluster
    labels = {model: f"spotdrain.io/model.{model}" for model in (installing.MODEL, installing.PREFETCHED)}

    def prefetched() -> dict[str, str] | None:
        on_node = cluster.get("node", SPOT.name)["metadata"]["labels"]
        states = {model: on_node.get(label, "") for model, label in labels.items()}
        return states if all(state in ("ready", "failed") for state in states.values()) else None

    try:
        states = cluster.wait_for("the node labelled for each model", prefetched, within_s=READY_WITHIN_S)
    except TimeoutError:
        states = None
    logs = cluster.kubectl(
        "logs", "-n", "spotdrain", "daemonset/spotdrain-node", "-c", "model-prefetch", "--tail", "60", check=False
    )
    assert states == dict.fromkeys(labels, "ready"), logs[-4000:]
    installed.timeline.note(f"prefetch: {', '.join(f'{label}=ready' for label in labels.values())}")
    assert "cache.prefetched" in logs, logs[-4000:]
    fetched = CACHE / "models" / installing.PREFETCHED
    for name, data in tiny_checkpoint().items():
        assert (fetched / name).read_bytes() == data, name
    counts: dict[str, int] = imds(cluster, "request_counts")
    role = [path for path in counts if path.endswith(f"iam/security-credentials/{NODE_ROLE}")]
    assert role, f"nothing read the instance role's credentials from IMDS: {counts}"


def test_spotdrain_check_finds_nothing_wrong_with_the_install(installed: installing.Installed) -> None:
    wait_ready(installed, "inference", "app.kubernetes.io/name=vllm", "vllm pod Ready (for the check)")
    found = findings(installed.cluster)
    warned = [f"{f['check']}: {f['message']}" for f in found if f["severity"] == "warning"]
    installed.timeline.note(f"spotdrain check: {len(found)} findings, no error, warnings: {warned or 'none'}")
    assert not errors(found)
    assert {"agent", "sidecar-injection", "budgets", "webhook"} <= {f["check"] for f in found}


GPU = {"nvidia.com/gpu": "1"}
ENGINE = {"name": "engine", "image": f"{installing.FAKE_ENGINE}:{installing.TAG}"}
USERS_ENGINE = {  # a pod a user creates; the one GPU is the installed engine's, so it stays Pending
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "a-users-engine", "namespace": "inference"},
    "spec": {"containers": [{**ENGINE, "resources": {"requests": GPU, "limits": GPU}}]},
}
# Each piece broken as a user might break it: the check that must report it, and the kubectl commands.
BREAKAGES: dict[str, tuple[str, list[tuple[str, ...]]]] = {
    # README.md: every PodDisruptionBudget over pods with the sidecar needs unhealthyPodEvictionPolicy: AlwaysAllow
    "budget": (
        "budgets",
        [
            (
                "patch",
                "pdb",
                "vllm",
                "-n",
                "inference",
                "--type=json",
                "-p",
                '[{"op": "remove", "path": "/spec/unhealthyPodEvictionPolicy"}]',
            )
        ],
    ),
    # a namespace labelled for injection and no webhook answering
    "webhook": ("webhook", [("scale", "deployment", "spotdrain-webhook", "-n", "spotdrain", "--replicas=0")]),
    # the namespace's label removed, and a GPU pod created there since: the webhook passes it by, no sidecar
    "namespace label": (
        "sidecar-injection",
        [("label", "namespace", "inference", "spotdrain.io/inject-"), ("create", "-f", "-")],
    ),
}
WEBHOOK = "app.kubernetes.io/name=spotdrain-webhook"


@pytest.mark.parametrize("broken", BREAKAGES)
def test_spotdrain_check_reports_a_piece_broken_on_purpose_until_it_is_restored(
    installed: installing.Installed, broken: str
) -> None:
    cluster = installed.cluster
    check, commands = BREAKAGES[broken]
    try:
        for command in commands:
            cluster.kubectl(*command, input=json.dumps(USERS_ENGINE) if command[-1] == "-" else None)
        if broken == "webhook":
            cluster.wait_for(
                "no webhook pod", lambda: not cluster.get("pods", "-n", "spotdrain", "-l", WEBHOOK)["items"]
            )
        found = errors(findings(cluster))
        installed.timeline.note(f"spotdrain check with the {broken} broken: {len(found)} error(s)")
        assert any(line.startswith(f"{check}:") for line in found), found
    finally:
        cluster.kubectl("delete", "pod", "a-users-engine", "-n", "inference", "--ignore-not-found", "--wait=true")
        installing.label_namespace(cluster, installed.timeline)
        cluster.kubectl("apply", "-k", str(installed.overlays["vllm"]))
        cluster.kubectl("apply", "-k", str(installed.overlays["webhook"]))
    wait_ready(installed, "spotdrain", WEBHOOK, f"a webhook replica Ready again after the {broken} check")
    assert not errors(findings(cluster))
