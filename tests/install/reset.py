"""The Spot node made new again after a case interrupted it, so the next case meets what a fresh node offers: in
production the instance is gone and Karpenter launches another; here the same node is given back.

``fresh_spot_node(installed)`` clears the fake IMDS's notices, takes off what the agent added (its taint, its
annotations, the cordon), restarts the node's agent pod (its notice board, which the sidecars long-poll, still holds
the old notice: a new pod's sidecar would read it and never become ready), and waits until every vllm replica is
Ready again, the one the drain evicted rescheduled on the node.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

from tests.install import installing, network
from tests.install.conftest import SPOT
from tests.install.node import Cluster

TAINT = "spotdrain.io/interruption"
ANNOTATIONS = ("spotdrain.io/notice", "spotdrain.io/added", "spotdrain.io/termination-time")
AGENT = "app.kubernetes.io/name=spotdrain-node"
ENGINE = "app.kubernetes.io/name=vllm"
READY_WITHIN_S = 180.0
TIMEOUT_S = 60.0


def imds(cluster: Cluster, method: str, **arguments: Any) -> Any:
    """Call a control method of the fake IMDS in the Spot node's network namespace (``POST /_control/<method>``)."""
    argv = ["curl", "-sf", "-m", "5", "-X", "POST", "-H", "Content-Type: application/json", "-d", json.dumps(arguments)]
    argv.append(f"http://{network.IMDS}/_control/{method}")
    namespace = cluster.node(SPOT.name).namespace
    done = subprocess.run(network.in_namespace(namespace, argv), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"the fake IMDS's {method}: {done.returncode} {done.stderr}"
    return json.loads(done.stdout)["result"] if done.stdout.strip() else None


def fresh_spot_node(installed: installing.Installed) -> None:
    cluster, note = installed.cluster, installed.timeline.note
    imds(cluster, "clear")
    node = cluster.get("node", SPOT.name)
    if any(taint["key"] == TAINT for taint in node["spec"].get("taints", [])):
        cluster.kubectl("taint", "node", SPOT.name, f"{TAINT}-")
    cluster.kubectl("annotate", "node", SPOT.name, *(f"{key}-" for key in ANNOTATIONS))
    cluster.kubectl("uncordon", SPOT.name)
    on_spot = f"spec.nodeName={SPOT.name}"
    before = {pod["metadata"]["uid"] for pod in pods(cluster, "spotdrain", AGENT, on_spot)}
    cluster.kubectl("delete", "pod", "-n", "spotdrain", "-l", AGENT, f"--field-selector={on_spot}", "--wait=true")

    def agent_back() -> bool:
        agents = pods(cluster, "spotdrain", AGENT, on_spot)
        return any(pod["metadata"]["uid"] not in before and ready(pod) for pod in agents)

    cluster.wait_for("the Spot node's agent restarted", agent_back, READY_WITHIN_S)
    replicas = int(cluster.get("deployment", "vllm", "-n", "inference")["spec"]["replicas"])

    def engines_ready() -> bool:
        engines = [pod for pod in pods(cluster, "inference", ENGINE) if not pod["metadata"].get("deletionTimestamp")]
        return len(engines) == replicas and all(ready(pod) for pod in engines)

    try:
        cluster.wait_for("every vllm replica Ready", engines_ready, READY_WITHIN_S)
    except TimeoutError:
        listed = cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False)
        described = cluster.kubectl("describe", "pods", "-n", "inference", "-l", ENGINE, check=False)
        raise AssertionError(f"the vllm replicas not Ready again\n{listed}\n{described[-6000:]}") from None
    note("the Spot node fresh again: notice cleared, marks removed, agent restarted, vllm Ready")


def pods(cluster: Cluster, namespace: str, selector: str, *fields: str) -> list[dict[str, Any]]:
    args = ["pods", "-n", namespace, "-l", selector, *(f"--field-selector={field}" for field in fields)]
    found: list[dict[str, Any]] = cluster.get(*args)["items"]
    return found


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
