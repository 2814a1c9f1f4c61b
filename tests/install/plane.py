"""The control plane of the end-to-end tier's nodes: etcd on 127.0.0.1, kube-apiserver on ``10.213.0.1:16443`` (the
host side of node 0's veth, where every node reaches it) with ServiceAccount admission on, kube-controller-manager
with the controllers a cluster's workloads need, and kube-scheduler; started with ``tests.control_plane``'s pieces
and the flags ``../shared/kube/README.md`` gives for a real node.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import control_plane
from tests.control_plane import ControlPlane
from tests.install import network
from tests.install.pki import Authority, KeyPair

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
SERVER = f"https://{network.API_HOST}:{network.API_PORT}"
# What Deployments, DaemonSets, Services, budgets, evictions and the pods' kube-api-access volumes need. This tree
# (OpenShift's) puts ConfigMap openshift-service-ca.crt in every kube-api-access volume, and only
# service-ca-certificate-publisher makes it.
CONTROLLERS = ",".join(
    f"{name}-controller"
    for name in (
        "serviceaccount",
        "serviceaccount-token",
        "root-ca-certificate-publisher",
        "service-ca-certificate-publisher",
        "endpoints",  # the API server's service proxy and its calls to webhooks read Endpoints
        "endpointslice",
        "deployment",
        "replicaset",
        "daemonset",
        "disruption",
        "namespace",
        "garbage-collector",
        "node-lifecycle",
        "pod-garbage-collector",
    )
)


def start(directory: Path, authority: Authority, bin_dir: Path) -> ControlPlane:
    """Start the four processes with files in ``directory``; return once the API server is ready and the
    controllers and scheduler are started. Stops what it started and raises if the API server does not come up."""
    sa_key = directory / "sa.key"
    control_plane._write_service_account_keys(sa_key, directory / "sa.pub")
    token = os.urandom(24).hex()
    user = control_plane.ADMIN_TOKEN_USER
    # token,user,uid,"groups": system:masters is the superuser group the RBAC authorizer always allows.
    (directory / "tokens.csv").write_text(f'{token},{user},{user},"system:masters"\n')
    plane = ControlPlane(directory, SERVER, authority.ca_path, token, sa_key)
    hosts = [network.API_HOST, network.KUBERNETES_SERVICE, "127.0.0.1", "localhost", "kubernetes"]
    hosts += ["kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"]
    serving = authority.serving("apiserver", hosts)
    to_kubelets = authority.client("apiserver-kubelet-client", "kube-apiserver-kubelet-client", ["system:masters"])
    try:
        plane.etcd_url = control_plane._start_etcd(plane, bin_dir)
        flags = _apiserver_flags(plane, serving, to_kubelets)
        plane.processes.append(control_plane._spawn(plane, bin_dir, "kube-apiserver", *flags))
        control_plane._wait_ready(plane)
        control_plane.write_kubeconfig(directory / "admin.kubeconfig", plane.url, plane.ca_path, token)
        controllers = authority.client("controller-manager", "system:kube-controller-manager")
        config = authority.kubeconfig(directory / "controller-manager.kubeconfig", SERVER, controllers)
        plane.processes.append(
            control_plane._spawn(plane, bin_dir, "kube-controller-manager", *_controller_flags(config, plane))
        )
        scheduler = authority.client("scheduler", "system:kube-scheduler")
        config = authority.kubeconfig(directory / "scheduler.kubeconfig", SERVER, scheduler)
        flags = [f"--kubeconfig={config}", "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0"]
        plane.processes.append(control_plane._spawn(plane, bin_dir, "kube-scheduler", *flags))
    except BaseException:
        plane.stop()
        raise
    return plane


def _apiserver_flags(plane: ControlPlane, serving: KeyPair, to_kubelets: KeyPair) -> list[str]:
    directory = plane.directory
    return [
        f"--bind-address={network.API_HOST}",
        f"--advertise-address={network.API_HOST}",
        f"--secure-port={network.API_PORT}",
        f"--etcd-servers={plane.etcd_url}",
        f"--tls-cert-file={serving.cert}",
        f"--tls-private-key-file={serving.key}",
        f"--client-ca-file={plane.ca_path}",
        f"--token-auth-file={directory / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={control_plane.ISSUER}",
        f"--service-account-key-file={directory / 'sa.pub'}",
        f"--service-account-signing-key-file={plane.sa_key_path}",
        f"--service-cluster-ip-range={network.SERVICE_RANGE}",
        "--allow-privileged=true",
        "--endpoint-reconciler-type=none",
        # `kubectl logs` and `exec` go through the kubelet, which trusts clients the CA signed
        f"--kubelet-client-certificate={to_kubelets.cert}",
        f"--kubelet-client-key={to_kubelets.key}",
        "--kubelet-preferred-address-types=InternalIP",  # the nodes' names resolve nowhere
        # No kube-proxy runs, so a Service's ClusterIP leads nowhere: admission webhooks and aggregated APIs are
        # called at an endpoint of their Service instead, a pod IP the host routes to its node.
        "--enable-aggregator-routing=true",
    ]


def _controller_flags(kubeconfig: Path, plane: ControlPlane) -> list[str]:
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        "--secure-port=0",
        "--leader-elect=false",
        f"--service-account-private-key-file={plane.sa_key_path}",
        f"--root-ca-file={plane.ca_path}",
        "--use-service-account-credentials=true",
        "--node-monitor-grace-period=50s",
        "--node-monitor-period=1s",  # the not-ready taint of a node that just became Ready goes 1 s later, not 5
        f"--controllers={CONTROLLERS}",
    ]
