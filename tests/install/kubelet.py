"""One node of the end-to-end tier: what a provisioner registers (``NodeSpec``), and its processes in its network
namespace: containerd (``tests.install.runtime``), the kubelet with the KubeletConfiguration known to work here
(``../shared/kube/README.md``), and whatever a test runs beside them, such as the fake IMDS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.install import network, plane, runtime, sweep
from tests.install.pki import Authority

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class NodeSpec:
    """A node as a provisioner registers it: its name, labels, taints (``key=value:Effect``), providerID, and the
    extended resources its device plugins would advertise (no device plugin runs here)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[str] = ()
    provider_id: str = ""
    extended_resources: Mapping[str, str] = field(default_factory=dict)


def spot_node(
    name: str = "ip-10-213-0-2.ec2.internal", instance_id: str = "i-0e2e0000000005b01", taints: Sequence[str] = ()
) -> NodeSpec:
    """A g5.xlarge Spot node with the labels Karpenter gives one (its instance id as EC2 makes them, ``i-`` and 17
    hex digits: the agent refuses any other from IMDS), which the agent's DaemonSet selects by
    ``karpenter.k8s.aws/instance-gpu-count``, and its one ``nvidia.com/gpu`` (advertised, not there)."""
    labels = {"karpenter.sh/capacity-type": "spot", "node.kubernetes.io/instance-type": "g5.xlarge"}
    labels |= {"topology.kubernetes.io/zone": "us-east-1a", "karpenter.sh/nodepool": "gpu-spot"}
    labels |= {"karpenter.k8s.aws/instance-family": "g5", "karpenter.k8s.aws/instance-size": "xlarge"}
    labels |= {"karpenter.k8s.aws/instance-gpu-count": "1", "karpenter.k8s.aws/instance-gpu-name": "a10g"}
    labels |= {"karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia"}
    return NodeSpec(name, labels, tuple(taints), f"aws:///us-east-1a/{instance_id}", {"nvidia.com/gpu": "1"})


def stable_node(name: str = "ip-10-213-1-2.ec2.internal", instance_id: str = "i-0e2e0000000005b02") -> NodeSpec:
    """An on-demand node beside it, for what must not run on Spot."""
    labels = {"karpenter.sh/capacity-type": "on-demand", "node.kubernetes.io/instance-type": "m6i.large"}
    labels |= {"topology.kubernetes.io/zone": "us-east-1a", "karpenter.sh/nodepool": "stable"}
    return NodeSpec(name, labels, (), f"aws:///us-east-1a/{instance_id}")


@dataclass
class Node:
    """One running node: its namespace, address, containerd socket and processes."""

    spec: NodeSpec
    index: int
    directory: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        return network.namespace(self.index)

    @property
    def address(self) -> str:
        return network.node_address(self.index)

    @property
    def socket(self) -> Path:
        return self.directory / "containerd" / "containerd.sock"

    @property
    def cgroup_root(self) -> str:
        return f"/{network.namespace(self.index)}"

    def run(self, argv: Sequence[str], *, log: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` in this node's network namespace (and nothing else), its output in ``log`` in the node's
        directory; it is stopped when the cluster is."""
        with (self.directory / log).open("ab") as out:
            process = subprocess.Popen(
                network.in_namespace(self.namespace, argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                cwd=ROOT,
                start_new_session=True,
                env={**os.environ, "PATH": f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"},
            )
        self.processes.append(process)
        return process

    def start_imds(self, *flags: str) -> subprocess.Popen[bytes]:
        """The fake IMDS (``simulate.fakes.imds``) on ``169.254.169.254:80`` in this node's namespace, answering
        for this node's instance (its providerID's last part) unless ``flags`` say otherwise; returns once it
        answers a token request."""
        instance = self.spec.provider_id.rpartition("/")[2] or "i-0123456789abcdef0"
        argv = [sys.executable, "-m", "simulate.fakes.imds", "--host", network.IMDS, "--port", "80"]
        process = self.run([*argv, "--instance-id", instance, *flags], log="imds.log")
        probe = ["curl", "-sf", "-m", "1", "-X", "PUT", "-H", "X-aws-ec2-metadata-token-ttl-seconds: 60"]
        probe.append(f"http://{network.IMDS}/latest/api/token")
        give_up = time.monotonic() + 20
        while subprocess.run(network.in_namespace(self.namespace, probe), capture_output=True, timeout=10).returncode:
            if process.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"the fake IMDS did not answer: see {self.directory / 'imds.log'}")
            time.sleep(0.1)
        return process

    def start_runtime(self, store: Path, images: Mapping[str, Path]) -> None:
        """Start containerd with its root in ``store`` (kept between runs) and import each of ``images`` (name:
        docker-archive) it does not hold yet."""
        root = store / "containerd" / self.spec.name  # kept: the images imported
        for path in (self.directory / "containerd", self.directory / "cni", root):
            path.mkdir(parents=True, exist_ok=True)
        (self.directory / "cni" / "10-bridge.conflist").write_text(
            runtime.cni_config(self.index, self.directory / "cni-ipam")
        )
        config = self.directory / "containerd.toml"
        config.write_text(runtime.config(root, self.directory / "containerd", self.directory / "cni"))
        step = time.monotonic()
        self.run(["containerd", "--config", str(config)], log="containerd.log")
        runtime.wait_serving(self.socket, self.directory / "containerd.log")
        # which archive each kept image came from: one whose archive changed is imported again
        imported = root / "imported.json"
        sources: dict[str, str] = json.loads(imported.read_text()) if imported.exists() else {}
        present = runtime.image_names(self.socket)
        for image, archive in images.items():
            if image not in present or sources.get(image) != str(archive):
                runtime.import_image(self.socket, archive)
                sources[image] = str(archive)
        imported.write_text(json.dumps(sources))
        self.timings["containerd with images"] = time.monotonic() - step

    def start_kubelet(self, authority: Authority, bin_dir: Path) -> None:
        """Start the kubelet, registering the node as its spec says."""
        name = self.spec.name
        pair = authority.client(f"kubelet-{self.index}", f"system:node:{name}", ["system:nodes"])
        kubeconfig = authority.kubeconfig(self.directory / "kubelet.kubeconfig", plane.SERVER, pair)
        sweep.make_cgroup_root(self.cgroup_root)
        (self.directory / "resolv.conf").write_text("")
        config = self.directory / "kubelet.json"
        config.write_text(json.dumps(_kubelet_config(self, authority.ca_path), indent=2))
        labels = ",".join(f"{key}={value}" for key, value in self.spec.labels.items())
        flags = [f"--config={config}", f"--kubeconfig={kubeconfig}", f"--root-dir={self.directory / 'kubelet'}"]
        flags += [f"--cert-dir={self.directory / 'kubelet-pki'}", f"--hostname-override={name}"]
        flags += [f"--node-ip={self.address}", f"--node-labels={labels}"]
        self.run([str(bin_dir / "kubelet"), *flags], log="kubelet.log")


def _kubelet_config(node: Node, ca_path: Path) -> dict[str, Any]:
    """The KubeletConfiguration known to work here (``../shared/kube/README.md``)."""
    taints = []
    for taint in node.spec.taints:
        pair, _, effect = taint.partition(":")
        key, _, value = pair.partition("=")
        taints.append({"key": key, "value": value, "effect": effect} if value else {"key": key, "effect": effect})
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",  # PID 1 is not systemd
        "cgroupRoot": node.cgroup_root,  # two kubelets on one machine: kubepods trees of their own
        "failCgroupV1": False,
        "failSwapOn": False,
        "oomScoreAdj": 0,  # root here lacks CAP_SYS_RESOURCE: the default -999 cannot be written
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "address": node.address,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(ca_path)},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "resolvConf": str(node.directory / "resolv.conf"),  # no nameserver to give pods
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,  # imported images cannot be pulled back
        "imageGCLowThresholdPercent": 99,
        "podLogsDir": str(node.directory / "logs"),
        "clusterDomain": "cluster.local",
        "providerID": node.spec.provider_id,
        "registerWithTaints": taints,
    }
