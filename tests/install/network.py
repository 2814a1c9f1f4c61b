"""The network of the end-to-end tier's nodes: each node a network namespace joined to the host by a veth of its own.

Node ``i`` has the host side ``10.213.i.1/24`` and the node side ``10.213.i.2/24`` (its InternalIP), pods in
``10.214.i.0/24`` on a CNI bridge inside the namespace, and ``169.254.169.254/32`` on its ``lo`` for a fake IMDS,
which pods on the bridge cannot reach (the IMDS hop limit of 1 the shipped EC2NodeClass sets).
The namespace routes only the tier's ranges to the host (no default route: no internet, no nameserver); the host
routes each node's pod range to its node, so pods reach pods on other nodes through the host's forwarding when it
is on (``net.ipv4.ip_forward``, which the tier reads and never sets). The API server listens on node 0's host side,
``10.213.0.1:16443``. No kube-proxy runs: the ``kubernetes`` Service is programmed in each namespace as kube-proxy's
iptables mode would program it, and every rule stays in the namespace, off the shared machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

PREFIX = "spotdrain-e2e-"  # of every namespace the tier makes, so a killed run's are found by name
LINK_PREFIX = "sde2e-"  # host side veths (15 characters at most: IFNAMSIZ)
API_HOST = "10.213.0.1"
API_PORT = 16443
SERVICE_RANGE = "10.96.0.0/16"
KUBERNETES_SERVICE = "10.96.0.1"
IMDS = "169.254.169.254"
TIMEOUT_S = 30.0


def namespace(index: int) -> str:
    return f"{PREFIX}{index}"


def host_address(index: int) -> str:
    return f"10.213.{index}.1"


def node_address(index: int) -> str:
    return f"10.213.{index}.2"


def pod_range(index: int) -> str:
    return f"10.214.{index}.0/24"


def in_namespace(name: str, argv: Sequence[str]) -> list[str]:
    """``argv`` run in the network namespace ``name`` and nothing else: ``ip netns exec`` would also give it a
    mount namespace with ``/sys`` remounted, where runc would not see the mounts the kubelet makes."""
    return ["nsenter", f"--net=/run/netns/{name}", *argv]


def run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def join(index: int) -> None:
    """Make node ``index``'s namespace, its veth, addresses, routes and Service rules."""
    name, host_link, node_link = namespace(index), f"{LINK_PREFIX}{index}", f"{LINK_PREFIX}{index}n"
    run("ip", "netns", "add", name)
    run("ip", "link", "add", host_link, "type", "veth", "peer", "name", node_link, "netns", name)
    run("ip", "addr", "add", f"{host_address(index)}/24", "dev", host_link)
    run("ip", "link", "set", host_link, "up")
    inside = [
        ["ip", "link", "set", "lo", "up"],
        ["ip", "addr", "add", f"{IMDS}/32", "dev", "lo"],
        ["ip", "link", "set", node_link, "name", "eth0"],
        ["ip", "addr", "add", f"{node_address(index)}/24", "dev", "eth0"],
        ["ip", "link", "set", "eth0", "up"],
    ]
    gateway = host_address(index)
    for target in ("10.213.0.0/16", "10.214.0.0/16", SERVICE_RANGE):
        inside.append(["ip", "route", "add", target, "via", gateway])
    service = ["-d", f"{KUBERNETES_SERVICE}/32", "-p", "tcp", "--dport", "443", "-j", "DNAT"]
    service += ["--to-destination", f"{API_HOST}:{API_PORT}"]
    inside.append(["iptables", "-t", "nat", "-A", "OUTPUT", *service])  # hostNetwork pods and the node itself
    inside.append(["iptables", "-t", "nat", "-A", "PREROUTING", *service])  # pods on the bridge
    # The EC2NodeClass's IMDS hop limit of 1 (deploy/components/karpenter): IMDS's answers reach the node's own
    # network namespace and die one hop further, in a pod's (docs.aws.amazon.com/AWSEC2/latest/UserGuide/
    # configuring-IMDS-existing-instances.html). Here IMDS is on the node's loopback, so no hop counts: pods'
    # requests to it are dropped instead, and only hostNetwork pods and the node reach it.
    inside.append(["iptables", "-A", "INPUT", "-s", pod_range(index), "-d", f"{IMDS}/32", "-j", "DROP"])
    for argv in inside:
        run(*in_namespace(name, argv))
    run("ip", "route", "add", pod_range(index), "via", node_address(index), "dev", host_link)


def namespaces() -> list[str]:
    """The tier's namespaces present now, this run's or a killed run's."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=TIMEOUT_S).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)]


def pids_in(name: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=TIMEOUT_S)
    return [int(pid) for pid in done.stdout.split()]


def remove(name: str) -> None:
    """Delete the namespace ``name``: its veth, routes and rules go with it. Its processes must be gone first."""
    subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=TIMEOUT_S)
    index = name.removeprefix(PREFIX)
    if Path(f"/sys/class/net/{LINK_PREFIX}{index}").exists():
        subprocess.run(["ip", "link", "delete", f"{LINK_PREFIX}{index}"], capture_output=True, timeout=TIMEOUT_S)


def missing_reason() -> str | None:
    """Why no node network can be made here, or None when it can."""
    probe = f"{LINK_PREFIX}probe"  # not PREFIX: a running sweep would take it for its own
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=TIMEOUT_S)
    if made.returncode != 0:
        return f"no network namespace can be made here: {made.stderr.strip()}"
    try:
        rules = subprocess.run(
            in_namespace(probe, ["iptables", "-t", "nat", "-S"]), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        if rules.returncode != 0:
            return f"iptables cannot program a node's namespace: {rules.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=TIMEOUT_S)
    return None
