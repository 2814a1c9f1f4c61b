"""spotdrain installed on the real nodes as README.md's "Install" and "Model cache" tell a user: the images built from
the Dockerfiles and imported into the nodes, then each step a ``kubectl apply -k`` of the shipped directory through
an overlay that sets only what a user sets (``images:``, and the documented flags and variables each patch names).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import yaml
from moto.moto_server.threaded_moto_server import ThreadedMotoServer

from simulate.model import tiny_checkpoint
from tests.install.engine import ROOT, Podman, build_file, tag_of, tail
from tests.install.node import Cluster, spot_node

# Named for the vllm/vllm-openai image it stands in for: the webhook tells a pod's engine by its image's name.
FAKE_ENGINE = "localhost/spotdrain-e2e/vllm-openai-fake"
TAG = "e2e"  # tag_of()'s tag: each overlay's images: points there
MODEL = "qwen2.5-7b-instruct"  # deploy/vllm's --name, under s3://my-bucket/models/ as its source says
# The Ray workers' model, which the NodePool's spotdrain.io/models tells a user to add: no pod here asks for it, so
# only the prefetch fetches it
PREFETCHED = "qwen2.5-1.5b-instruct"
BUCKET = "my-bucket"
MODELS = "spotdrain.io/models"
SAVE_TIMEOUT_S = 300.0


class Timeline:
    """What the install saw, each entry at its seconds since the install began."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.entries: list[tuple[float, str]] = []

    def note(self, what: str) -> None:
        self.entries.append((time.monotonic() - self.started, what))

    def lines(self) -> list[str]:
        return [f"[install] {seconds:6.1f} s  {what}" for seconds, what in self.entries]


def build_fake_engine(podman: Podman, directory: Path) -> str:
    """The fake engine's image (tests/install/Dockerfile.fake-engine) from a context of simulate/ alone; its tag."""
    context = directory / "fake-engine"
    shutil.copytree(ROOT / "simulate", context / "simulate", ignore=shutil.ignore_patterns("__pycache__"))
    tag = f"{FAKE_ENGINE}:{TAG}"
    done = build_file(podman, Path(__file__).with_name("Dockerfile.fake-engine"), tag, context)
    if done.returncode != 0:
        raise AssertionError(f"the fake engine's image does not build:\n{tail(done.stdout + done.stderr, 60)}")
    return tag


def save(podman: Podman, tags: Sequence[str], archive: Path) -> Path:
    """The images as one docker-archive, as ``podman save`` gives it to a user who moves images by hand."""
    podman.run("save", "--format", "docker-archive", "-m", "-o", str(archive), *tags, timeout_s=SAVE_TIMEOUT_S)
    return archive


def overlay(
    directory: Path,
    base: str | Path,
    images: Sequence[Mapping[str, str]],
    patches: Sequence[Mapping[str, Any]] = (),
    components: Sequence[str] = (),
) -> Path:
    """A user's kustomization over ``base`` (a shipped directory, or another overlay): its ``components``,
    ``images:`` and ``patches``."""
    directory.mkdir(parents=True, exist_ok=True)
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(ROOT / base, directory)],  # kustomize takes no absolute path
        "images": [dict(image) for image in images],
    }
    if components:
        kustomization["components"] = [os.path.relpath(ROOT / component, directory) for component in components]
    if patches:
        kustomization["patches"] = [dict(patch) for patch in patches]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return directory


def ours(*programs: str) -> list[dict[str, str]]:
    """``images:`` entries that point the shipped images at the ones built here."""
    return [{"name": tag_of(program).rpartition(":")[0], "newTag": TAG} for program in programs]


def json_patch(kind: str, name: str, operations: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {"target": {"kind": kind, "name": name}, "patch": json.dumps(list(operations))}


def agent_overlay(directory: Path, device: str, endpoint: str) -> Path:
    """daemonset/imds-mode with the agent's image and deploy/components/model-prefetch, as README.md's "Model
    cache" composes them; the cache's disk named by ``--model-cache-devices`` (docs/model-cache.md): this machine's
    instance store is a loop device, which discovery by the disks' model name (Amazon EC2 NVMe Instance Storage)
    rightly passes over; and the prefetch's S3 endpoint, ``AWS_ENDPOINT_URL`` (docs/model-cache.md), moto's. Its
    credentials are the node's instance role's, from IMDS on the host network, as where no IRSA webhook gives the
    pod the role its ServiceAccount names."""
    devices = {
        "op": "add",
        "path": "/spec/template/spec/initContainers/0/args/-",
        "value": f"--model-cache-devices={device}",
    }
    env = {"name": "AWS_ENDPOINT_URL", "value": endpoint}
    prefetch: list[dict[str, Any]] = [
        {"op": "test", "path": "/spec/template/spec/containers/0/name", "value": "model-prefetch"},
        {"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": env},
    ]
    # kustomize applies an overlay's patches before its components: the prefetch's container is patched from above
    composed = overlay(directory / "composed", "daemonset/imds-mode", (), (), ["deploy/components/model-prefetch"])
    patches = [json_patch("DaemonSet", "spotdrain-node", [devices, *prefetch])]
    return overlay(directory, composed, ours("agent"), patches)


def webhook_overlay(directory: Path) -> Path:
    """deploy/webhook/self-managed with the webhook's image, and the sidecar image it injects in its
    SPOTDRAIN_SIDECAR_IMAGE, which README.md says to patch because images: does not reach it."""
    env = [{"name": "SPOTDRAIN_SIDECAR_IMAGE", "value": tag_of("sidecar")}]
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "spotdrain-webhook", "namespace": "spotdrain"},
        "spec": {"template": {"spec": {"containers": [{"name": "webhook", "env": env}]}}},
    }
    patch = {"patch": yaml.safe_dump(deployment)}  # a strategic merge: env entries merge by name
    return overlay(directory, "deploy/webhook/self-managed", ours("webhook"), [patch])


def vllm_overlay(directory: Path, endpoint: str) -> Path:
    """deploy/vllm as it fits here. What changes, and why:

    - the engine's image is the fake engine's (vLLM needs a GPU this machine lacks), with the fake's flags in place
      of vLLM's: the same port, the served name, and ``--model-dir`` at the fetched model, which it reads before it
      listens as vLLM loads it; ``--host 0.0.0.0`` because the kubelet probes the pod's address;
    - its requests (4 cores, 32 GiB) down to what the fake needs, the GPU kept: the machine has 2 cores and 24 GB;
    - one replica: the spread over hosts is strict, and there is one Spot GPU node;
    - the model-fetch init container gets the S3 endpoint (``AWS_ENDPOINT_URL``, docs/model-cache.md) and keys in
      the environment where the pod identity webhook gives it the IRSA role's web identity: that is exchanged at
      AWS's STS, which the fetch's signer (awscrt) asks at AWS's own address whatever the endpoint, and the pods
      cannot use the node's instance role (the EC2NodeClass's IMDS hop limit of 1 keeps them from IMDS).
    """
    engine_args = ["--host", "0.0.0.0", "--port", "8000", "--model", "Qwen/Qwen2.5-7B-Instruct"]
    engine_args += ["--model-dir", f"/mnt/model-cache/models/{MODEL}"]
    resources = {"requests": {"cpu": "100m", "memory": "128Mi", "nvidia.com/gpu": "1"}}
    resources["limits"] = {"memory": "256Mi", "nvidia.com/gpu": "1"}
    credentials = [
        {"name": "AWS_ENDPOINT_URL", "value": endpoint},
        {"name": "AWS_ACCESS_KEY_ID", "value": "testing"},
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "testing"},
    ]
    template = "/spec/template/spec"
    operations: list[dict[str, Any]] = [
        {"op": "replace", "path": "/spec/replicas", "value": 1},
        {"op": "test", "path": f"{template}/containers/0/name", "value": "vllm"},
        {"op": "replace", "path": f"{template}/containers/0/args", "value": engine_args},
        {"op": "replace", "path": f"{template}/containers/0/resources", "value": resources},
        {"op": "test", "path": f"{template}/initContainers/0/name", "value": "model-fetch"},
        {"op": "add", "path": f"{template}/initContainers/0/env", "value": credentials},
    ]
    images = [*ours("agent", "sidecar"), {"name": "vllm/vllm-openai", "newName": FAKE_ENGINE, "newTag": TAG}]
    return overlay(directory, "deploy/vllm", images, [json_patch("Deployment", "vllm", operations)])


CACHE = Path("/mnt/model-cache")  # the agent's hostPath, on the machine every node shares
STATE = Path("/var/lib/spotdrain")  # the agent's state hostPath, made by the kubelet if absent
CACHE_DISK_BYTES = 512 << 20  # mkfs.xfs refuses a filesystem under 300 MB


@dataclass
class Installed:
    cluster: Cluster
    device: str
    overlays: dict[str, Path]
    timeline: Timeline


def install(
    cluster: Cluster,
    tags: list[str],
    podman: Podman,
    s3: ThreadedMotoServer,
    directory: Path,
    timeline: Timeline,
) -> Installed:
    """The images imported, the model uploaded, then each step of README.md applied; returns at once."""
    tags = [*tags, build_fake_engine(podman, directory)]
    timeline.note("images built")
    cluster.import_image(save(podman, tags, directory / "images.tar"))
    timeline.note("images imported into the nodes")
    s3.start()
    endpoint = "http://{}:{}".format(*s3.get_host_and_port())
    upload_models(endpoint, directory / "models")
    timeline.note(f"models uploaded to s3://{BUCKET}/models/: {MODEL}, {PREFETCHED}")
    cluster.share(CACHE)
    device = cluster.attach_loop(CACHE_DISK_BYTES)
    annotate_as_karpenter(cluster)
    overlays = {
        "agent": agent_overlay(directory / "agent", device, endpoint),
        "webhook": webhook_overlay(directory / "webhook"),
        "vllm": vllm_overlay(directory / "vllm", endpoint),
    }
    cluster.kubectl("apply", "-k", str(overlays["agent"]))
    timeline.note("applied daemonset/imds-mode")
    cluster.kubectl("apply", "-k", str(overlays["webhook"]))
    timeline.note("applied deploy/webhook/self-managed")
    label_namespace(cluster, timeline)
    cluster.kubectl("apply", "-k", str(overlays["vllm"]))
    timeline.note("applied deploy/vllm")
    return Installed(cluster, device, overlays, timeline)


def annotate_as_karpenter(cluster: Cluster) -> None:
    """The Spot node with the annotations of deploy/components/karpenter's NodePool template, which Karpenter puts
    on the nodes it launches: ``spotdrain.io/models`` names the models the prefetch fetches, the Ray workers' added
    as its comment tells a user who runs them."""
    pool = yaml.safe_load((ROOT / "deploy/components/karpenter/nodepool.yaml").read_text())
    annotations = dict(pool["spec"]["template"]["metadata"]["annotations"])
    annotations[MODELS] += f",{PREFETCHED}=s3://{BUCKET}/models/{PREFETCHED}/"
    cluster.kubectl("annotate", "node", "--overwrite", spot_node().name, *(f"{k}={v}" for k, v in annotations.items()))


def upload_models(endpoint: str, directory: Path) -> None:
    """The tiny checkpoint uploaded as each model, file by file with boto3's upload_file, as a user's script would."""
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    for name, data in tiny_checkpoint().items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        for model in (MODEL, PREFETCHED):
            client.upload_file(str(path), BUCKET, f"models/{model}/{name}")


def label_namespace(cluster: Cluster, timeline: Timeline) -> None:
    """README.md's ``kubectl label namespace inference spotdrain.io/inject=true``. The namespace is deploy/vllm's,
    applied after it: where the label finds no namespace, it is made first, as a user then must."""
    labelled = cluster.kubectl("label", "namespace", "inference", "spotdrain.io/inject=true", check=False)
    if not labelled:
        timeline.note("kubectl label namespace inference: no such namespace yet; created it")
        cluster.kubectl("create", "namespace", "inference")
        cluster.kubectl("label", "namespace", "inference", "spotdrain.io/inject=true")
    timeline.note("labelled namespace inference")
