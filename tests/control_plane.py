"""A real Kubernetes control plane on 127.0.0.1 for the tests: etcd, kube-apiserver and kube-controller-manager
(the disruption and EndpointSlice controllers), from the static binaries in ``../shared/kube`` beside the
repository (``SPOTDRAIN_KUBE_BINARIES`` points elsewhere).

The binaries are decompressed once into ``~/.cache/spotdrain-kube/<digest>`` (``XDG_CACHE_HOME`` is honoured), keyed
by the compressed files' digest so a new build lands beside an old one. Each start gets its own CA, serving
certificate, service-account keys and bearer tokens in a temporary directory, and ports picked free on 127.0.0.1.
There is no kubelet: tests create, bind and report pods themselves (``tests.real_kube``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import lzma
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from simulate.fakes.processes import free_port
from simulate.fakes.tls import write_tls_files

ROOT = Path(__file__).resolve().parents[1]
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
ADMIN_TOKEN_USER = "spotdrain-test-admin"
ISSUER = "https://kubernetes.default.svc.cluster.local"
# No garbage collector: the tests' pods name owners (ReplicaSets, DaemonSets) that are not there, which it would
# delete them for.
CONTROLLERS = "disruption-controller,endpointslice-controller"
READY_WITHIN_S = 60.0


def binaries_dir() -> Path:
    """Where the compressed binaries are: ``SPOTDRAIN_KUBE_BINARIES``, else ``../shared/kube`` beside the
    repository (where CI's clone finds the shared folder)."""
    configured = os.environ.get("SPOTDRAIN_KUBE_BINARIES")
    return Path(configured) if configured else ROOT.parent / "shared" / "kube"


def missing_reason(names: Sequence[str] = BINARIES) -> str | None:
    """Why the real control plane (or the binaries ``names``) cannot run here, or None when it can."""
    source = binaries_dir()
    absent = [name for name in names if not (source / f"{name}.xz").is_file()]
    if absent:
        files = ", ".join(f"{name}.xz" for name in absent)
        return f"no {files} in {source} (the real Kubernetes control plane): set SPOTDRAIN_KUBE_BINARIES"
    return None


def unpacked(names: Sequence[str] = BINARIES) -> Path:
    """The uncompressed binaries ``names`` in the cache, made on first use (atomically: a rename of a complete
    file)."""
    source = binaries_dir()
    digest = hashlib.sha256()
    for name in names:
        digest.update((source / f"{name}.xz").read_bytes())
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "spotdrain-kube" / digest.hexdigest()[:16]
    )
    cache.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = cache / name
        if target.exists():
            continue
        partial = cache / f".{name}.{os.getpid()}"
        with lzma.open(source / f"{name}.xz") as packed, partial.open("wb") as out:
            shutil.copyfileobj(packed, out, length=1 << 20)
        partial.chmod(0o755)
        partial.rename(target)
    return cache


@dataclass
class ControlPlane:
    """The three processes and what clients need to reach the API server as its administrator."""

    directory: Path
    url: str
    ca_path: Path
    admin_token: str
    sa_key_path: Path
    etcd_url: str = ""
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def compact(self) -> None:
        """Compact etcd at its current revision, as the API server itself does every 5 minutes
        (``--etcd-compaction-interval``). A watch of a resource served from etcd rather than the watch cache
        (events) from an older resourceVersion is then answered 410 Expired."""
        header = _etcd_post(self.etcd_url, "/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]
        _etcd_post(self.etcd_url, "/v3/kv/compaction", {"revision": header["revision"], "physical": True})

    def stop(self) -> None:
        """SIGTERM each process by its pid, newest first, then SIGKILL what has not exited within 2 s (the API
        server's graceful shutdown waits for watches that nothing here needs to end cleanly)."""
        for process in reversed(self.processes):
            if process.poll() is None:
                os.kill(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            try:
                process.wait(2)
            except subprocess.TimeoutExpired:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(5)

    def log_tail(self, name: str, lines: int = 30) -> str:
        text = (self.directory / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


def start(directory: Path) -> ControlPlane:
    """Start etcd, the API server and the controller manager with files in ``directory``; return once the API
    server answers ``/readyz`` with ``ok``. Stops what it started and raises if it does not."""
    bin_dir = unpacked()
    tls = write_tls_files(directory / "tls")
    sa_key = directory / "sa.key"
    _write_service_account_keys(sa_key, directory / "sa.pub")
    token = os.urandom(24).hex()
    # token,user,uid,"groups": system:masters is the superuser group the RBAC authorizer always allows.
    (directory / "tokens.csv").write_text(f'{token},{ADMIN_TOKEN_USER},{ADMIN_TOKEN_USER},"system:masters"\n')
    port = free_port()
    plane = ControlPlane(directory, f"https://127.0.0.1:{port}", tls.ca_path, token, sa_key)
    try:
        plane.etcd_url = _start_etcd(plane, bin_dir)
        _start_apiserver(plane, bin_dir, plane.etcd_url, port, tls.cert_path, tls.key_path)
        _wait_ready(plane)
        kubeconfig = write_kubeconfig(directory / "admin.kubeconfig", plane.url, plane.ca_path, token)
        plane.processes.append(_spawn(plane, bin_dir, "kube-controller-manager", *_controller_flags(kubeconfig, plane)))
    except BaseException:
        plane.stop()
        raise
    return plane


def write_kubeconfig(path: Path, server: str, ca_path: Path, token: str, *, namespace: str = "default") -> Path:
    """A kubeconfig (JSON, which YAML readers take) for ``server`` with a bearer token."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "real", "cluster": {"server": server, "certificate-authority": str(ca_path)}}],
        "users": [{"name": "real", "user": {"token": token}}],
        "contexts": [{"name": "real", "context": {"cluster": "real", "user": "real", "namespace": namespace}}],
        "current-context": "real",
    }
    path.write_text(json.dumps(config, indent=2))
    return path


def _write_service_account_keys(private: Path, public: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _spawn(plane: ControlPlane, bin_dir: Path, name: str, *flags: str) -> subprocess.Popen[bytes]:
    with (plane.directory / f"{name}.log").open("ab") as log:
        return subprocess.Popen(
            [str(bin_dir / name), *flags],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            cwd=plane.directory,
            start_new_session=True,  # a ^C to pytest reaches it through stop(), not twice
        )


def _start_etcd(plane: ControlPlane, bin_dir: Path) -> str:
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    flags = ["--name", "t", "--data-dir", str(plane.directory / "etcd"), "--listen-client-urls", client]
    flags += ["--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer]
    flags += ["--initial-cluster", f"t={peer}", "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}"]
    plane.processes.append(_spawn(plane, bin_dir, "etcd", *flags))
    return client


def _etcd_post(etcd_url: str, path: str, body: dict[str, object]) -> dict[str, Any]:
    """One call to etcd's JSON gateway (the v3 API over HTTP, on its client URL)."""
    request = urllib.request.Request(f"{etcd_url}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        parsed: dict[str, Any] = json.load(answer)
        return parsed


def _start_apiserver(plane: ControlPlane, bin_dir: Path, etcd_url: str, port: int, cert: Path, key: Path) -> None:
    directory = plane.directory
    flags = [
        "--bind-address=127.0.0.1",
        f"--secure-port={port}",
        "--advertise-address=127.0.0.1",
        f"--etcd-servers={etcd_url}",
        f"--tls-cert-file={cert}",
        f"--tls-private-key-file={key}",
        f"--client-ca-file={plane.ca_path}",
        f"--token-auth-file={directory / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        f"--service-account-issuer={ISSUER}",
        f"--service-account-key-file={directory / 'sa.pub'}",
        f"--service-account-signing-key-file={plane.sa_key_path}",
        "--service-cluster-ip-range=10.96.0.0/16",
        "--allow-privileged=true",
        "--endpoint-reconciler-type=none",
        # Pods here name their service account themselves; no token controller runs to create `default`.
        "--disable-admission-plugins=ServiceAccount",
    ]
    plane.processes.append(_spawn(plane, bin_dir, "kube-apiserver", *flags))


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
        "--use-service-account-credentials=false",
        f"--controllers={CONTROLLERS}",
    ]


def _wait_ready(plane: ControlPlane) -> None:
    context = ssl.create_default_context(cafile=str(plane.ca_path))
    request = urllib.request.Request(f"{plane.url}/readyz", headers={"Authorization": f"Bearer {plane.admin_token}"})
    give_up = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < give_up:
        for process in plane.processes:
            if process.poll() is not None:
                name = Path(str(process.args[0])).name  # type: ignore[index]
                raise RuntimeError(f"{name} exited with {process.returncode}:\n{plane.log_tail(name)}")
        try:
            with urllib.request.urlopen(request, timeout=2, context=context) as answer:
                if answer.read() == b"ok":
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"kube-apiserver not ready within {READY_WITHIN_S} s:\n{plane.log_tail('kube-apiserver')}")


def temporary_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="spotdrain-kube-real-"))
