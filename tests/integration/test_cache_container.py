"""``spotdrain cache`` as the DaemonSet's init container runs it: its command, args and env from the manifest, in a
mount namespace of its own where the hostPath is bind-mounted at the cache path, as the kubelet does.

What the runtime does, and these tests after it (containerd's CRI plugin and runc): for ``mountPropagation:
Bidirectional`` the host directory must be on a shared mount (containerd's ``ensureShared`` refuses it otherwise), the
container's mount namespace is a copy of the host's made rshared, its rootfs's parent mount is made private (runc's
``rootfsParentMountPrivate``), and the hostPath is bound with ``rbind`` and made ``rshared``. A bind of a shared mount
joins its peer group, so a mount made over it in the container appears at the host directory. ``HostToContainer`` is
``rslave``, ``None`` ``rprivate`` (Kubernetes' "Mount propagation" page, and the CRI's ``MountPropagation``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.cache.plan import PENDING_TAINT
from simulate.fakes.kube import FakeKube
from tests.integration.test_cache_devices import (
    NODE,
    kube,
    loops,
    mounted_at,
    needs,
    needs_loop,
    node_state,
    quietly,
    sh,
    signature,
)

__all__ = ["kube", "loops"]  # the fixtures, shared with test_cache_devices

DAEMONSET = Path(__file__).parents[2] / "daemonset/base/daemonset.yaml"
PROPAGATION = {"Bidirectional": "--make-rshared", "HostToContainer": "--make-rslave", "None": "--make-rprivate"}
TIMEOUT_S = 120  # mkfs.xfs of a 300 MB loop device on a busy 2-core machine, with room

# Runs in the container's mount namespace: the kubelet's bind, the program, then what the container sees at the path
# (the visible filesystem's device number, and findmnt's entry for it), on stdout; the program's own output on stderr.
CONTAINER = """
bind=$1 point=$2 propagation=$3; shift 3
mount --rbind "$bind" "$point" && mount "$propagation" "$point" || exit 125
"$@" >&2; code=$?
stat -c %d "$point"; findmnt -n -r -o SOURCE,FSROOT,PROPAGATION,LABEL --mountpoint "$point" | tail -n 1
exit $code
"""

needs_namespaces = needs("unshare")
needs_md = pytest.mark.skipif(not Path("/proc/mdstat").exists(), reason="RAID0 needs the kernel's md driver")
DISKS = [pytest.param(1, id="one-disk"), pytest.param(2, id="raid0", marks=[needs("mdadm"), needs_md])]


@dataclasses.dataclass(frozen=True)
class Node:
    """The node's side: the hostPath directory, and the container's rootfs (its cache path below it)."""

    host_path: Path
    rootfs: Path


@dataclasses.dataclass(frozen=True)
class Ran:
    code: int
    seen_device: int | None  # st_dev of what the container sees at the cache path once the program has exited
    seen_mount: list[str]  # findmnt's SOURCE, FSROOT, PROPAGATION, LABEL of the topmost mount there
    stderr: str

    def steps(self) -> list[str]:
        """The actions of the steps the program ran, from its ``cache.step`` log events."""
        events = [json.loads(line) for line in self.stderr.splitlines() if line.startswith("{")]
        return [e["action"] for e in events if e.get("event") == "cache.step"]


@dataclasses.dataclass(frozen=True)
class InitContainer:
    """The DaemonSet's ``model-cache`` init container, and its hostPath volume of the same name."""

    command: list[str]
    args: list[str]
    env: list[dict[str, Any]]
    mount: dict[str, Any]
    host_path: str

    @classmethod
    def load(cls) -> InitContainer:
        documents = [d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d]
        spec = next(d for d in documents if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
        container = next(c for c in spec["initContainers"] if c["name"] == "model-cache")
        mount = next(m for m in container["volumeMounts"] if m["name"] == "model-cache")
        volume = next(v for v in spec["volumes"] if v["name"] == "model-cache")
        return cls(container["command"], container["args"], container["env"], mount, volume["hostPath"]["path"])


INIT = InitContainer.load()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """The host directory made a shared mount (``mount --bind D D && mount --make-rshared D``, what the kubelet needs
    for Bidirectional where the host's / is not shared) and a private rootfs, so the container's own mounts stay in
    its namespace. Every mount at either is taken off at the end, the cache's propagated one included."""
    made = Node(tmp_path / "host" / INIT.host_path.lstrip("/"), tmp_path / "rootfs")
    for directory in (made.host_path, made.rootfs):
        directory.mkdir(parents=True)
    try:
        sh("mount", "--bind", str(made.host_path), str(made.host_path))
        sh("mount", "--make-rshared", str(made.host_path))
        sh("mount", "--bind", str(made.rootfs), str(made.rootfs))
        sh("mount", "--make-rprivate", str(made.rootfs))
        yield made
    finally:
        unmount_all(made.host_path)
        unmount_all(made.rootfs)


def unmount_all(point: Path) -> None:
    while mounted_at(point) is not None:
        sh("umount", str(point))


def rerooted(arg: str, node: Node) -> str:
    """An absolute path of the manifest's args, as the program sees it in the test's rootfs."""
    return str(node.rootfs / arg.lstrip("/")) if arg.startswith("/") else arg


async def run_init_container(
    node: Node, kube: FakeKube, devices: Sequence[str], *, propagation: str | None = None, more: Sequence[str] = ()
) -> Ran:
    """One start of the init container, in a new mount namespace (the host's mounts copied, propagation unchanged)."""
    assert INIT.command[0] == "spotdrain"
    program = [sys.executable, "-m", "spotdrain.cli", *INIT.command[1:]]
    args = [rerooted(a, node) for a in INIT.args]
    args += ["--model-cache-devices", ",".join(devices), *more]
    args += ["--kubeconfig", str(kube.write_kubeconfig(node.rootfs.parent / "kubeconfig"))]
    env = dict(os.environ, **{e["name"]: NODE for e in INIT.env if e["name"] == "NODE_NAME"})
    point = node.rootfs / INIT.mount["mountPath"].lstrip("/")
    point.mkdir(parents=True, exist_ok=True)
    flag = PROPAGATION[propagation or INIT.mount.get("mountPropagation", "None")]
    argv = ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", CONTAINER, "sh"]
    process = await asyncio.create_subprocess_exec(
        *argv,
        str(node.host_path),
        str(point),
        flag,
        *program,
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), TIMEOUT_S)
    finally:
        if process.returncode is None:  # the program too, not only the shell
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode != 125, err.decode()  # the bind itself failed: no test of the program
    lines = out.decode().splitlines()
    seen = int(lines[0]) if lines and lines[0].isdigit() else None
    return Ran(process.returncode or 0, seen, lines[1].split(" ") if len(lines) > 1 else [], err.decode())


def host_sees(node: Node) -> tuple[int, list[str]]:
    """The device of what the host sees at its directory, and the host's topmost mount entry there."""
    entry = sh("findmnt", "-n", "-r", "-o", "SOURCE,FSROOT,PROPAGATION", "--mountpoint", str(node.host_path))
    return os.stat(node.host_path).st_dev, entry.splitlines()[-1].split(" ")


@needs_loop
@needs_namespaces
@needs("mkfs.xfs")
@pytest.mark.parametrize("count", DISKS)
async def test_the_init_container_mounts_the_cache_over_the_hostpath_bind_and_the_host_sees_it(
    loops: Callable[[int], list[str]], kube: FakeKube, node: Node, count: int
) -> None:
    name = f"sd-ct-{os.getpid()}"  # a RAID0's name on the host's md driver, its own for this test
    disks = loops(count)
    try:
        first = await run_init_container(node, kube, disks, more=["--model-cache-name", name])
        assert first.code == 0, first.stderr
        target = disks[0] if count == 1 else os.path.realpath(f"/dev/md/{name}")
        device = os.stat(target).st_rdev
        assert "format" in first.steps()
        assert (first.seen_device, first.seen_mount) == (device, [target, "/", "shared", "model-cache"])
        assert host_sees(node) == (device, [target, "/", "shared"])  # propagated from the container's namespace
        assert node_state(kube) == ("ready", [])
        (node.host_path / "weights.bin").write_bytes(b"layers")

        restart = await run_init_container(node, kube, disks, more=["--model-cache-name", name])
        assert (restart.code, restart.steps(), restart.seen_device) == (0, [], device), restart.stderr

        sh("umount", str(node.host_path))  # a reboot: the disks keep the cache, nothing is mounted
        assert os.stat(node.host_path).st_dev != device
        reboot = await run_init_container(node, kube, disks, more=["--model-cache-name", name])
        assert (reboot.code, reboot.steps(), reboot.seen_device) == (0, ["mkdir", "mount"], device), reboot.stderr
        assert host_sees(node)[0] == device
        assert (node.host_path / "weights.bin").read_bytes() == b"layers"
    finally:
        if count > 1:  # an array in use cannot be stopped
            unmount_all(node.host_path)
            quietly("mdadm", "--stop", f"/dev/md/{name}")


@needs_loop
@needs_namespaces
@needs("mkfs.ext4")
async def test_a_foreign_filesystem_at_the_host_path_is_refused_and_the_disk_left_blank(
    loops: Callable[[int], list[str]], kube: FakeKube, node: Node
) -> None:
    disk, foreign = loops(2)
    sh("mkfs.ext4", "-q", "-L", "data", foreign)
    sh("mount", foreign, str(node.host_path))
    ran = await run_init_container(node, kube, [disk])
    assert ran.code == 1
    assert f"already mounted from {foreign} (ext4), not from {disk}" in ran.stderr
    assert (signature(disk), node_state(kube)) == ({}, (None, [PENDING_TAINT]))


@needs_loop
@needs_namespaces
async def test_a_hostpath_mounted_without_bidirectional_is_refused_before_anything_is_written(
    loops: Callable[[int], list[str]], kube: FakeKube, node: Node
) -> None:
    [disk] = loops(1)
    ran = await run_init_container(node, kube, [disk], propagation="HostToContainer")
    assert ran.code == 1
    assert "not a shared mount" in ran.stderr
    assert "mountPropagation: Bidirectional" in ran.stderr
    assert (signature(disk), ran.steps(), node_state(kube)) == ({}, [], (None, [PENDING_TAINT]))
