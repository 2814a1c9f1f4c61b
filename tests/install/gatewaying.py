"""spotdrain gateway on the real nodes, installed as docs/install.md tells a user ("also build Dockerfile.gateway,
apply ``kubectl apply -k deploy/gateway``"): its image built and imported, then ``deploy/gateway`` through an overlay
that sets only ``images:`` and the replica count; a replica of the engine on the stable node for the gateway to
continue streams on; and a completion streamed through the API server's proxy as a client reads it, line by line.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.install import installing
from tests.install.cases import Moments
from tests.install.conftest import STABLE, Images
from tests.install.engine import Podman
from tests.install.node import Cluster
from tests.install.test_install import wait_ready

GATEWAY = "app.kubernetes.io/name=spotdrain-gateway"
SERVICE_PROXY = "/api/v1/namespaces/inference/services/spotdrain-gateway:http/proxy"
ON_DEMAND = "vllm-on-demand"
ON_DEMAND_PODS = f"app.kubernetes.io/instance={ON_DEMAND}"
GPU = "nvidia.com/gpu"
CACHE_LABEL = "spotdrain.io/model-cache"
SPLICE = ": spotdrain: continued after "  # the comment docs/gateway.md says --mark-splices (on by default) writes
TIMEOUT_S = 60.0


def overlay(directory: Path) -> Path:
    """deploy/gateway with the gateway's image, and one replica: the shipped two are spread over hosts strictly, on
    on-demand nodes, and there is one on-demand node (the second would stay Pending)."""
    one = {"op": "replace", "path": "/spec/replicas", "value": 1}
    patch = installing.json_patch("Deployment", "spotdrain-gateway", [one])
    return installing.overlay(directory, "deploy/gateway", installing.ours("gateway"), [patch])


def install(installed: installing.Installed, images: Images, podman: Podman) -> dict[str, Any]:
    """The gateway's image imported into the nodes and deploy/gateway applied (again: applying is idempotent); its
    Ready pod. It stays installed for the later cases (test_metrics.py scrapes it)."""
    cluster, directory = installed.cluster, installed.overlays["vllm"].parent
    tag = images("gateway").tag
    cluster.import_image(installing.save(podman, [tag], directory / "gateway.tar"))
    installed.timeline.note("gateway image imported into the nodes")
    installed.overlays["gateway"] = overlay(directory / "gateway")
    cluster.kubectl("apply", "-k", str(installed.overlays["gateway"]))
    installed.timeline.note("applied deploy/gateway")
    return wait_ready(installed, "inference", GATEWAY, "gateway pod Ready")


def advertise_gpu(cluster: Cluster, *, on: bool) -> None:
    """The stable node as the GPU pool's on-demand capacity (deploy/components/karpenter's NodePool takes on-demand
    when Spot is short): one ``nvidia.com/gpu`` in its status, as a device plugin would have the kubelet advertise it
    ("Advertise Extended Resources for a Node", kubernetes.io/docs/tasks/administer-cluster/), and the cache label
    the agent's init container sets once the cache is mounted. The cache on this machine is one directory for both
    nodes, holding the model the Spot replica fetched; no agent runs on the stable node (the machine has one cache
    disk, the Spot node's), so ``spotdrain check`` would rightly report it: ``on=False`` takes both away again."""
    path = GPU.replace("/", "~1")
    operations: list[dict[str, str]] = [
        {"op": "add", "path": f"/status/{part}/{path}", "value": "1"}
        if on
        else {"op": "remove", "path": f"/status/{part}/{path}"}
        for part in ("capacity", "allocatable")
    ]
    if on or GPU in cluster.get("node", STABLE.name)["status"].get("capacity", {}):
        patch = ["patch", "node", STABLE.name, "--subresource=status", "--type=json", "-p", json.dumps(operations)]
        cluster.kubectl(*patch)
    cluster.kubectl("label", "node", STABLE.name, f"{CACHE_LABEL}=ready" if on else f"{CACHE_LABEL}-", "--overwrite")


def on_demand_replica(installed: installing.Installed) -> dict[str, Any]:
    """The install's engine Deployment (deploy/vllm as installing.py's overlay renders it) again, as
    ``vllm-on-demand``: one replica kept on on-demand capacity, as a user keeps a floor of replicas off Spot, behind
    the same ``vllm`` Service (its pods carry ``app.kubernetes.io/name: vllm``); its own selector label keeps the two
    Deployments' ReplicaSets apart. Nothing else of deploy/vllm is copied: a second budget over the same pods would
    make every eviction of them fail."""
    rendered = yaml.safe_load_all(installed.cluster.kubectl("kustomize", str(installed.overlays["vllm"])))
    deployment: dict[str, Any] = next(item for item in rendered if item and item["kind"] == "Deployment")
    deployment["metadata"]["name"] = ON_DEMAND
    own = {"app.kubernetes.io/instance": ON_DEMAND}
    deployment["spec"]["replicas"] = 1
    deployment["spec"]["selector"]["matchLabels"] |= own
    template = deployment["spec"]["template"]
    template["metadata"]["labels"] |= own
    template["spec"]["nodeSelector"] = {"karpenter.sh/capacity-type": "on-demand"}
    return deployment


@contextmanager
def on_demand(installed: installing.Installed) -> Iterator[dict[str, Any]]:
    """The stable node offering a GPU and ``vllm-on-demand`` on it while the block runs; its Ready pod. Afterwards
    the GPU is taken away first, so that no Pending replica of ``vllm`` (the Spot one a drain evicted) takes it once
    the on-demand one is gone, then the Deployment is deleted and its pod waited for."""
    cluster = installed.cluster
    advertise_gpu(cluster, on=True)
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(on_demand_replica(installed)))
        yield wait_ready(installed, "inference", ON_DEMAND_PODS, "vllm-on-demand pod Ready on the stable node")
    finally:
        advertise_gpu(cluster, on=False)
        delete = ["delete", "deployment", ON_DEMAND, "-n", "inference", "--cascade=foreground", "--ignore-not-found"]
        cluster.kubectl(*delete, "--wait=true", timeout_s=TIMEOUT_S * 2)


@dataclass
class Stream:
    """One completion POSTed through the API server's proxy at ``path``, read as a client reads server-sent events:
    each line with when it came (seconds on ``moments``' clock). ``start()`` runs it in the background; ``kubectl``
    asks it with ``kubectl create --raw`` instead (client-go, which gives the body whole once it has ended)."""

    cluster: Cluster
    path: str
    request: dict[str, Any]
    moments: Moments
    name: str
    kubectl: bool = False
    lines: list[tuple[float, str]] = field(default_factory=list)
    status: int = 0
    failure: str = ""
    thread: threading.Thread | None = None

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self._ask if self.kubectl else self._read, daemon=True)
        self.thread.start()
        return self

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(timeout=TIMEOUT_S * 2)

    def _read(self) -> None:
        config = json.loads(self.cluster.kubeconfig.read_text())
        server = urlsplit(config["clusters"][0]["cluster"]["server"])
        context = ssl.create_default_context(cafile=config["clusters"][0]["cluster"]["certificate-authority"])
        connection = http.client.HTTPSConnection(str(server.hostname), server.port, context=context, timeout=TIMEOUT_S)
        try:
            # the administrator's kubeconfig (tests/control_plane.py) carries a bearer token
            headers = {
                "Content-Type": "application/json",
                "Authorization": f"Bearer {config['users'][0]['user']['token']}",
            }
            connection.request("POST", f"{self.path}/v1/completions", body=json.dumps(self.request), headers=headers)
            response = connection.getresponse()
            self.status = response.status
            while line := response.readline():  # each read bounded by the connection's timeout
                self._line(line.decode())
            if not self.lines:
                self.failure = f"no body: {response.getheaders()}"
        except (OSError, http.client.HTTPException) as error:
            self.failure = repr(error)
        finally:
            connection.close()
            self.moments.mark(f"{self.name}: ended")

    def _ask(self) -> None:
        argv = ["create", "--raw", f"{self.path}/v1/completions", "-f", "-"]
        try:
            answer = self.cluster.kubectl(*argv, input=json.dumps(self.request), timeout_s=TIMEOUT_S)
            self.status = 200
            for line in answer.splitlines():
                self._line(line)
        except AssertionError as error:
            self.failure = str(error)
        finally:
            self.moments.mark(f"{self.name}: ended")

    def _line(self, line: str) -> None:
        self.lines.append((time.monotonic() - self.moments.started, line.rstrip("\r\n")))
        if line.startswith("data: "):
            self.moments.mark(f"{self.name}: first event read by the client")

    def chunks(self) -> list[str]:
        return [line.removeprefix("data: ") for _, line in self.lines if line.startswith("data: ")]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(chunk) for chunk in self.chunks() if chunk != "[DONE]"]

    def text(self) -> str:
        return "".join(c["text"] for event in self.events() for c in event.get("choices") or [])

    def tokens(self) -> int:
        counted = [event["usage"]["completion_tokens"] for event in self.events() if event.get("usage")]
        return int(counted[-1]) if counted else -1

    def splices(self) -> list[tuple[float, int, str]]:
        """Each splice comment: when it came, how many chunks with a choice the client had before it, its cause."""
        found, chunks = [], 0
        for at, line in self.lines:
            if line.startswith(SPLICE):
                found.append((at, chunks, line.removeprefix(SPLICE)))
            elif line.startswith("data: {") and json.loads(line.removeprefix("data: ")).get("choices"):
                chunks += 1
        return found
