"""Each node's containerd (Debian's 1.6, with runc): its configuration, its start in the node's network namespace,
images imported into it, and the removal of every container it still holds.

Settings from ``../shared/kube/README.md``: a root, state, sockets and opt path of its own; ``restrict_oom_score_adj``
(root here cannot lower an OOM score); runc without systemd cgroups (PID 1 is not systemd); CNI from
``/usr/lib/cni`` with a configuration directory of its own. The root (images and snapshots) is kept between runs in
the cache, so a warm run imports nothing; the state (sockets, the sandboxes' network namespaces) is the run's.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from tests.install import network

SANDBOX_IMAGE = "localhost/spotdrain-e2e/pause:1"
CTR_TIMEOUT_S = 120.0


def config(root: Path, state: Path, cni_dir: Path) -> str:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{state}/containerd.sock"
[ttrpc]
  address = "{state}/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"
[{cri}]
  sandbox_image = "{SANDBOX_IMAGE}"
  restrict_oom_score_adj = true
  # the sandboxes' network namespaces under the state directory, not the machine's /run/netns
  netns_mounts_under_state_dir = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{state}/runc"
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_dir}"
"""


def cni_config(index: int, ipam_dir: Path) -> str:
    bridge = {
        "type": "bridge",
        "bridge": "cni0",
        "isGateway": True,
        "ipMasq": True,
        "ipam": {
            "type": "host-local",
            "ranges": [[{"subnet": network.pod_range(index)}]],
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": str(ipam_dir),
        },
    }
    return json.dumps({"cniVersion": "0.4.0", "name": "spotdrain-e2e", "plugins": [bridge]}, indent=2)


def ctr(socket: Path, *args: str, stdin: Path | None = None) -> str:
    argv = ["ctr", "--address", str(socket), "--namespace", "k8s.io", *args]
    if stdin is None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CTR_TIMEOUT_S)
    else:
        with stdin.open("rb") as source:
            done = subprocess.run(argv, stdin=source, capture_output=True, text=True, timeout=CTR_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def wait_serving(socket: Path, log: Path, within_s: float = 30.0) -> None:
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        if socket.exists():
            probe = subprocess.run(["ctr", "--address", str(socket), "version"], capture_output=True, timeout=10)
            if probe.returncode == 0:
                return
        time.sleep(0.1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
    raise TimeoutError(f"containerd did not serve {socket} within {within_s} s:\n{tail}")


def image_names(socket: Path) -> set[str]:
    return set(ctr(socket, "images", "list", "--quiet").split())


def import_image(socket: Path, archive: Path) -> None:
    """Import a docker-archive (``podman save``), plain or xz-compressed, as ``ctr image import`` does."""
    if archive.name.endswith(".xz"):
        with lzma.open(archive) as packed:
            done = subprocess.run(
                ["ctr", "--address", str(socket), "--namespace", "k8s.io", "images", "import", "-"],
                input=packed.read(),
                capture_output=True,
                timeout=CTR_TIMEOUT_S,
            )
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {archive} failed: {done.stderr.decode(errors='replace')}")
    else:
        ctr(socket, "images", "import", str(archive))


def remove_containers(socket: Path) -> None:
    """Kill every task by its id (shims outlive containerd) and delete every container, sandboxes included."""
    for task in _running_tasks(socket):
        _quietly(socket, "tasks", "kill", "--signal", "SIGKILL", task)
    give_up = time.monotonic() + 15
    while _running_tasks(socket) and time.monotonic() < give_up:
        time.sleep(0.2)
    for task in ctr(socket, "tasks", "list", "--quiet").split():
        _quietly(socket, "tasks", "delete", "--force", task)
    for container in ctr(socket, "containers", "list", "--quiet").split():
        _quietly(socket, "containers", "delete", container)


def _running_tasks(socket: Path) -> list[str]:
    """The ids of the tasks not stopped yet (``ctr tasks list``: TASK PID STATUS)."""
    rows = [line.split() for line in ctr(socket, "tasks", "list").splitlines()[1:]]
    return [row[0] for row in rows if len(row) == 3 and row[2] != "STOPPED"]


def _quietly(socket: Path, *args: str) -> None:
    """One ctr call whose failure the caller's later steps make up for (a task gone meanwhile)."""
    argv = ["ctr", "--address", str(socket), "--namespace", "k8s.io", *args]
    subprocess.run(argv, capture_output=True, timeout=CTR_TIMEOUT_S)


def remove_images_except(socket: Path, keep: set[str]) -> None:
    """Remove every image but ``keep`` (containerd's garbage collection then frees their content): what a run
    imported does not pile up in the root kept between runs."""
    extra = sorted(image_names(socket) - keep)
    if extra:
        ctr(socket, "images", "remove", *extra)


def sandbox_archive(cache: Path) -> Path:
    """A docker-archive of the pods' sandbox image, made once in ``cache``, whose entrypoint sleeps until killed
    (nothing can be pulled here, and the stand-in Python image's CMD exits at once without a terminal)."""
    target = cache / "sandbox.tar"
    if not target.exists():
        busybox_archive(target, SANDBOX_IMAGE, ["/bin/busybox", "sleep", "2147483647"])
    return target


def busybox_archive(target: Path, tag: str, entrypoint: list[str]) -> Path:
    """Write a docker-archive of an image ``tag`` holding Debian's busybox and the libraries it links."""
    busybox = Path(shutil.which("busybox") or "/bin/busybox")
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        made: set[str] = set()
        for path, name in [(busybox, "bin/busybox"), *_libraries(busybox)]:
            for parent in reversed(Path(name).parents[:-1]):
                if str(parent) not in made:
                    made.add(str(parent))
                    directory = tarfile.TarInfo(str(parent))
                    directory.type, directory.mode = tarfile.DIRTYPE, 0o755
                    tar.addfile(directory)
            tar.add(path.resolve(), arcname=name)
    layer_bytes = layer.getvalue()
    diff_id = f"sha256:{hashlib.sha256(layer_bytes).hexdigest()}"
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }
    config_bytes = json.dumps(image_config).encode()
    manifest = [{"Config": "config.json", "RepoTags": [tag], "Layers": ["layer.tar"]}]
    partial = target.with_name(f".{target.name}.{time.monotonic_ns()}")
    with tarfile.open(partial, mode="w") as tar:
        for name, data in [("layer.tar", layer_bytes), ("config.json", config_bytes)]:
            _add(tar, name, data)
        _add(tar, "manifest.json", json.dumps(manifest).encode())
    partial.rename(target)
    return target


def _libraries(binary: Path) -> list[tuple[Path, str]]:
    """The shared objects ``binary`` links, from ldd, at the paths the loader looks for them."""
    listed = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, timeout=10).stdout
    found = []
    for line in listed.splitlines():
        words = line.split()
        path = words[2] if "=>" in words and len(words) > 2 else words[0] if words else ""
        if path.startswith("/"):
            found.append((Path(path), path.lstrip("/")))
    return found


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
