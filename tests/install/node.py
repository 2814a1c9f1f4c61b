"""Real Kubernetes nodes for the end-to-end tier. ``with Cluster([spot_node(), stable_node()]) as cluster:`` starts
the control plane (``tests.install.plane``) and, for each node, a network namespace (``tests.install.network``)
running containerd (``tests.install.runtime``) and the kubelet (``tests.install.kubelet``), registered with the
labels, taints and providerID its ``NodeSpec`` gives; the block runs once every node is Ready and the ``default``
namespace can hold pods. Pods run for real: runc containers on a CNI bridge, ServiceAccount tokens, probes,
EndpointSlices, ``kubectl logs``. Leaving the block stops it all as ``../shared/kube/README.md`` says and leaves
nothing behind (``tests.install.sweep``); entering raises ``Unavailable`` with the reason where it cannot run.

In the block: ``cluster.kubeconfig`` (the administrator's), ``cluster.kubectl(*args)``, ``cluster.get(...)``,
``cluster.import_image(archive)`` into every node, ``cluster.node(name)`` with ``.address``, ``.run(argv, log=)``
in its network namespace and ``.start_imds()``, ``cluster.attach_loop(size)``, ``cluster.namespace_ready(name)``,
``cluster.wait_for(what, probe)`` and ``cluster.timings``.

Binaries are unpacked once into ``~/.cache/spotdrain-kube`` (``tests.control_plane``); the sandbox image, the
stand-in Python image's tar and each node's containerd root (its images) are kept between runs in
``/var/tmp/spotdrain-e2e/node`` (``SPOTDRAIN_E2E_NODE_STORE`` moves it), and the last run's logs in its ``run``
folder until the next run. The nodes' addresses are fixed, so one run at a time holds them: another waits for its
lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

from tests import control_plane
from tests.control_plane import ControlPlane
from tests.install import network, plane, runtime, sweep
from tests.install.kubelet import Node, NodeSpec, spot_node, stable_node
from tests.install.pki import Authority

__all__ = ["Cluster", "NodeSpec", "Unavailable", "missing_reason", "spot_node", "stable_node"]

ROOT = Path(__file__).resolve().parents[2]
STORE = Path(os.environ.get("SPOTDRAIN_E2E_NODE_STORE", "/var/tmp/spotdrain-e2e/node"))
IMAGES = ROOT.parent / "shared" / "images"  # where CI's clone finds the shared folder, as tests/control_plane.py does
PYTHON_ARCHIVE = "python-3.11-slim-bookworm.tar.xz"
PYTHON_IMAGE = "docker.io/library/python:3.11-slim-bookworm"
READY_WITHIN_S = 90.0
LOCK_WITHIN_S = 900.0  # a whole tier's run
_RUNNING: list[Cluster] = []
TOOLS = ("curl", "containerd", "runc", "ctr", "kubectl", "nsenter", "iptables", "ip", "losetup", "busybox", "ldd")
CNI_PLUGINS = ("bridge", "host-local", "loopback")


def missing_reason() -> str | None:
    """Why real nodes cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "a node needs root (network namespaces, mounts, cgroups)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    absent += [f"/usr/lib/cni/{name}" for name in CNI_PLUGINS if not Path(f"/usr/lib/cni/{name}").exists()]
    if absent:
        return f"missing {', '.join(absent)} (Debian: containerd runc containernetworking-plugins iptables busybox)"
    reason = control_plane.missing_reason(plane.BINARIES)
    if reason is not None:
        return reason
    if not (IMAGES / PYTHON_ARCHIVE).is_file():
        return f"no {PYTHON_ARCHIVE} in {IMAGES} (the stand-in image the pods run)"
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        return "no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory (the kubelet here runs on cgroup v1)"
    return network.missing_reason()


class Cluster:
    """The control plane and ``nodes`` (node ``i`` on ``10.213.i.2``), as a context manager whose block runs once
    every node is Ready and the ``default`` namespace can hold pods. ``timings`` holds each phase's seconds."""

    def __init__(self, nodes: Sequence[NodeSpec], *, progress: TextIO | None = sys.stderr) -> None:
        self.specs = list(nodes)
        self.directory = STORE / "run"
        self.nodes: list[Node] = []
        self.plane: ControlPlane | None = None
        self.timings: dict[str, float] = {}
        self.loops: list[str] = []
        self._progress = progress
        self._lock: TextIO | None = None

    @property
    def kubeconfig(self) -> Path:
        return self.directory / "admin.kubeconfig"

    def node(self, name: str) -> Node:
        return next(node for node in self.nodes if node.spec.name == name)

    def kubectl(self, *args: str, input: str | None = None, timeout_s: float = 60.0, check: bool = True) -> str:
        """Run kubectl as the cluster's administrator; its output, or AssertionError with its stderr if it failed
        and ``check``."""
        argv = ["kubectl", f"--kubeconfig={self.kubeconfig}", f"--request-timeout={int(timeout_s)}s", *args]
        done = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout_s + 10)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def get(self, *args: str) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.kubectl("get", "-o", "json", *args))
        return parsed

    def import_image(self, archive: Path) -> None:
        """Import a docker-archive (``podman save``; plain or .xz) into every node's containerd."""
        _together([partial(runtime.import_image, node.socket, archive) for node in self.nodes])

    def attach_loop(self, size_bytes: int) -> str:
        """A loop device over a sparse file of ``size_bytes``, detached when the cluster stops."""
        image = self.directory / f"loop{len(self.loops)}.img"
        with image.open("wb") as file:
            file.truncate(size_bytes)
        device = network.run("losetup", "--find", "--show", str(image)).strip()
        self.loops.append(device)
        return device

    def share(self, path: Path) -> Path:
        """Make ``path`` (on the machine every node shares) a shared mount point, as the hostPath of a
        ``mountPropagation: Bidirectional`` volume must be; it is unmounted, with whatever pods mounted under it,
        when the cluster stops, and removed if this made it."""
        sweep.share(STORE, path)
        return path

    def wait_for(self, what: str, probe: Any, within_s: float = READY_WITHIN_S) -> Any:
        """Poll ``probe()`` until it returns something true; that, or TimeoutError naming ``what``."""
        give_up = time.monotonic() + within_s
        while True:
            found = probe()
            if found:
                return found
            if time.monotonic() > give_up:
                raise TimeoutError(f"{what} not within {within_s} s")
            time.sleep(0.25)

    def namespace_ready(self, name: str) -> None:
        """Wait until pods can be made in namespace ``name``: its ServiceAccount ``default`` and the two ConfigMaps
        every kube-api-access volume names exist."""

        def ready() -> bool:
            names = {item["metadata"]["name"] for item in self.get("configmaps,serviceaccounts", "-n", name)["items"]}
            return {"default", "kube-root-ca.crt", "openshift-service-ca.crt"} <= names

        self.wait_for(f"namespace {name} ready for pods", ready)

    # Starting and stopping -------------------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        reason = missing_reason()
        if reason is not None:
            raise Unavailable(reason)
        STORE.mkdir(parents=True, exist_ok=True)
        if _RUNNING:
            # the lock is per open file: a second Cluster here would wait for the first for good
            raise RuntimeError("a Cluster is already running in this process: share it")
        self._lock = (STORE / "lock").open("w")
        give_up = time.monotonic() + LOCK_WITHIN_S
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > give_up:
                    self._lock.close()
                    raise Unavailable(f"another run has held {STORE / 'lock'} for {LOCK_WITHIN_S} s") from None
                time.sleep(1)
        _RUNNING.append(self)
        try:
            self._start()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop()

    def _phase(self, name: str, started: float) -> None:
        self._record(name, time.monotonic() - started)

    def _record(self, name: str, seconds: float) -> None:
        self.timings[name] = seconds
        if self._progress is not None:
            print(f"[e2e node] {name}: {self.timings[name]:.1f} s", file=self._progress, flush=True)

    def _start(self) -> None:
        started = time.monotonic()
        sweep.sweep(STORE)  # what a killed run left
        sweep.note_fixed_paths(STORE)
        self.directory.mkdir(parents=True)
        bin_dir = control_plane.unpacked(plane.BINARIES)
        images = {runtime.SANDBOX_IMAGE: runtime.sandbox_archive(STORE), PYTHON_IMAGE: _python_tar()}
        self._phase("binaries and images cached", started)
        authority = Authority(self.directory / "pki")
        for index, spec in enumerate(self.specs):
            network.join(index)
            self.nodes.append(Node(spec, index, self.directory / f"n{index}"))
        runtimes = [partial(node.start_runtime, STORE, images) for node in self.nodes]

        def control() -> None:
            step = time.monotonic()
            self.plane = plane.start(self.directory, authority, bin_dir)
            self._phase("control plane ready", step)

        _together([control, *runtimes])  # the images import while the API server starts
        for node in self.nodes:
            for name, seconds in node.timings.items():
                self._record(f"{node.spec.name}: {name}", seconds)
        step = time.monotonic()
        for node in self.nodes:
            node.start_kubelet(authority, bin_dir)
        self.wait_for("every node Ready", self._all_ready)
        for node in self.nodes:
            self._advertise(node.spec)
        self._phase("nodes Ready", step)
        self.namespace_ready("default")
        self._phase("cluster up", started)

    def _advertise(self, spec: NodeSpec) -> None:
        """Add the node's extended resources to its status as its device plugins would have the kubelet do. The
        kubelet keeps an extended resource no device plugin registered, and admits pods that request it
        ("Advertise Extended Resources for a Node", kubernetes.io/docs/tasks/administer-cluster/)."""
        patch = [
            {"op": "add", "path": f"/status/{field}/{name.replace('/', '~1')}", "value": value}
            for name, value in spec.extended_resources.items()
            for field in ("capacity", "allocatable")
        ]
        if patch:
            self.kubectl("patch", "node", spec.name, "--subresource=status", "--type=json", "-p", json.dumps(patch))

    def _all_ready(self) -> bool:
        """Every node Ready, and untainted by the node lifecycle controller (whose not-ready taint outlives the
        condition by a moment): as a provisioner's node is when its first pods are scheduled."""
        ready = set()
        for item in self.get("nodes")["items"]:
            conditions = {c["type"]: c["status"] for c in item["status"].get("conditions", [])}
            lifecycle = [t for t in item["spec"].get("taints", []) if t["key"].startswith("node.kubernetes.io/")]
            if conditions.get("Ready") == "True" and not lifecycle:
                ready.add(item["metadata"]["name"])
        for node in self.nodes:
            for process in node.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args!r} of {node.spec.name} exited: see {node.directory}")
        return ready >= {spec.name for spec in self.specs}

    def _stop(self) -> None:
        """The README's stop: pods deleted through the API (the kubelets stop their sandboxes and CNI releases
        their addresses), leftover tasks killed by id, the daemons by pid, then what remains swept."""
        if self.plane is not None and all(p.poll() is None for p in self.plane.processes):
            for process in self.plane.processes[2:]:  # no controller recreates a pod, no scheduler binds one
                process.terminate()
            self.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=1", "--wait=false", check=False)
            alive = [n for n in self.nodes if all(p.poll() is None for p in n.processes)]
            if alive:
                with contextlib.suppress(TimeoutError, AssertionError, subprocess.TimeoutExpired):
                    # what is left then is killed below
                    self.wait_for("pods gone", lambda: not self.get("pods", "-A")["items"], within_s=30)
        for node in self.nodes:
            if node.socket.exists():
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    runtime.remove_containers(node.socket)
                    runtime.remove_images_except(node.socket, {runtime.SANDBOX_IMAGE, PYTHON_IMAGE})
            for process in reversed(node.processes):
                sweep.stop_process(process)
        if self.plane is not None:
            self.plane.stop()
        for device in self.loops:
            subprocess.run(["losetup", "--detach", device], capture_output=True, timeout=30)
        sweep.sweep(STORE, keep_logs=True)  # the logs stay for a failure's reader until the next run
        sweep.remove_made_paths(STORE)
        if self._lock is not None:
            self._lock.close()
        if self in _RUNNING:
            _RUNNING.remove(self)


class Unavailable(Exception):
    """Real nodes cannot run here: the tests that need them skip with this reason."""


def _together(calls: Sequence[Callable[[], object]]) -> None:
    """Run ``calls`` each in a thread; raise the first one's exception once all have returned."""
    errors: list[BaseException] = []

    def guarded(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:  # handed to the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _python_tar() -> Path:
    """The stand-in image as a plain docker-archive in the store, decompressed once (``ctr import`` then reads
    it in ~5 s instead of decompressing 28 MB of xz for each node)."""
    digest = hashlib.sha256((IMAGES / PYTHON_ARCHIVE).read_bytes()).hexdigest()[:16]
    target = STORE / f"{PYTHON_ARCHIVE.removesuffix('.tar.xz')}-{digest}.tar"  # a new stand-in lands beside
    if not target.exists():
        for older in STORE.glob(f"{PYTHON_ARCHIVE.removesuffix('.tar.xz')}*.tar"):
            older.unlink()
        partial = STORE / f".{target.name}.{os.getpid()}"
        with lzma.open(IMAGES / PYTHON_ARCHIVE) as packed, partial.open("wb") as out:
            shutil.copyfileobj(packed, out, length=1 << 20)
        partial.rename(target)
    return target
