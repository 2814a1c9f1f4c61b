"""Pure decisions of the model cache: which commands bring the disks to a mounted cache, and how the node changes.

``plan_cache`` is a function of what probing found (each disk's signature from ``blkid``, what is mounted at the cache
path, the assembled array, the recorded array configuration). It returns the steps still needed, as data; the I/O
layer runs them, probes again and plans again until nothing is left, so a ready node gets an empty plan and its disks
are not written to. Reassembling an array is planned alone: the filesystem on it is known only once it is back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from agent.cache.models import names_models
from agent.cache.settings import CacheSettings

LABEL = "model-cache"  # the cache filesystem's label; xfs labels hold at most 12 characters
READY_LABEL = "spotdrain.io/model-cache"
PENDING_TAINT = "spotdrain.io/model-cache-pending"
RAID_MEMBER = "linux_raid_member"
NOTHING_TO_DO = "no instance-store disks: nothing to do"


class CacheError(Exception):
    """A step failed: which one, on which device, and what the command said."""

    def __init__(self, step: str, device: str, output: str) -> None:
        super().__init__(f"model cache: {step} failed on {device}: {output}")
        self.step = step
        self.device = device
        self.output = output


@dataclass(frozen=True)
class Disk:
    """A block device as probed; ``real`` is its path with symlinks resolved, as mount tables name it."""

    path: str
    real: str
    fstype: str | None = None
    label: str | None = None
    uuid: str | None = None
    ptable: str | None = None

    @property
    def blank(self) -> bool:
        return self.fstype is None and self.ptable is None

    def describe(self) -> str:
        if self.ptable is not None:
            return f"a {self.ptable} partition table"
        label = f" (label {self.label!r})" if self.label else ""
        return f"{self.fstype}{label}" if self.fstype else "nothing"


@dataclass(frozen=True)
class Mounted:
    """The topmost mount at the cache path, from ``/proc/self/mountinfo``.

    ``root`` is the directory of the source filesystem mounted there: ``/`` for a filesystem mounted at the path, the
    directory for a bind mount. The kubelet bind-mounts a hostPath into the container, so the init container always
    finds one at the cache path: the host directory (``/mnt/model-cache``) on the host's root device. ``shared``: the
    mount is in a peer group, so a mount made on it appears on its peers too (the host's, with Bidirectional).
    """

    source: str
    fstype: str
    root: str = "/"
    shared: bool = False

    @property
    def bound_directory(self) -> bool:
        """A directory bound here rather than a filesystem: mounting over it hides, and so changes, nothing of it."""
        return self.root != "/"


@dataclass(frozen=True)
class ProbeState:
    disks: Mapping[str, Disk]
    mounted: Mounted | None = None  # what is mounted at the cache path
    array: Disk | None = None  # /dev/md/<name>, when it is assembled
    recorded: str | None = None  # the recorded array configuration (mdadm.conf lines)


@dataclass(frozen=True)
class Step:
    action: str  # a short name: wipe, create-array, assemble-array, record-array, format, mkdir, mount
    device: str
    argv: tuple[str, ...]
    description: str
    stdout_to: str | None = None  # the command's output is written to this file (the array's record)


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    reason: str
    target: str | None  # the block device that is (or is to be) mounted; None: no cache on this node


@dataclass(frozen=True)
class _Layout:
    steps: list[Step] = field(default_factory=list)
    target: Disk | None = None  # None while the array is being reassembled
    reason: str = ""


def plan_cache(devices: Sequence[str], state: ProbeState, settings: CacheSettings) -> Plan:
    """The steps still needed to mount the cache; raises CacheError where going on would destroy foreign data."""
    if not devices:
        return Plan((), NOTHING_TO_DO, None)
    if len(devices) == 1:
        array = _Layout(target=state.disks[devices[0]], reason="a single disk")
    else:
        array = _plan_array([state.disks[d] for d in devices], state, settings)
    if array.target is None:
        return Plan(tuple(array.steps), array.reason, settings.array_path)
    target, mounted = array.target, state.mounted
    if mounted is not None and not mounted.bound_directory:
        if mounted.source != target.real:
            source = f"{mounted.source} ({mounted.fstype})"
            raise CacheError("mount", str(settings.path), f"already mounted from {source}, not from {target.path}")
        return Plan(tuple(array.steps), f"{array.reason}: mounted at {settings.path}", target.path)
    if mounted is not None:
        _check_propagation(mounted, settings)
    steps = array.steps + _plan_filesystem(target, settings) + _plan_mount(target, settings)
    over = "" if mounted is None else f", over the directory bound at {settings.path} ({mounted.source}:{mounted.root})"
    return Plan(tuple(steps), array.reason + over, target.path)


def _check_propagation(bound: Mounted, settings: CacheSettings) -> None:
    """Refuse a bound directory whose mounts would stay in this mount namespace, before anything is written.

    Mounted over such a bind (a hostPath with ``HostToContainer`` or no propagation), the cache would vanish with
    the init container while the node is labelled ready and the pods write their models onto the root volume.
    """
    if not bound.shared:
        source = f"{bound.source}:{bound.root}"
        refusal = (
            f"it is a directory bound from {source} that is not a shared mount, so a cache mounted there would reach "
            "neither the host nor the inference pods; mount the hostPath with mountPropagation: Bidirectional"
        )
        raise CacheError("mount", str(settings.path), refusal)


def _own_filesystem(disk: Disk) -> bool:
    return disk.ptable is None and disk.fstype not in (None, RAID_MEMBER) and disk.label == LABEL


def _ours(disk: Disk, name: str) -> bool:
    """The cache's own filesystem, or a member of the cache's array (md names it ``<host>:<name>``)."""
    if disk.fstype == RAID_MEMBER and disk.ptable is None:
        return disk.label is not None and (disk.label == name or disk.label.endswith(f":{name}"))
    return _own_filesystem(disk)


def _plan_filesystem(target: Disk, settings: CacheSettings) -> list[Step]:
    if _own_filesystem(target):
        return []  # the cache's own filesystem, whatever its type: formatting it again would drop the cache
    if target.blank:
        return [_mkfs(target.path, settings.fs, overwrite=False)]
    if not (settings.force or _ours(target, settings.name)):
        refusal = f"it carries {target.describe()}, not the cache's {LABEL!r}; --model-cache-force formats it"
        raise CacheError("format", target.path, refusal)
    return [_wipe(target.path), _mkfs(target.path, settings.fs, overwrite=True)]


def _plan_array(members: list[Disk], state: ProbeState, settings: CacheSettings) -> _Layout:
    name, path = settings.name, settings.array_path
    uuids = {m.uuid for m in members}
    uuid = next(iter(uuids)) if len(uuids) == 1 else None
    if state.array is not None:
        return _Layout(_record(settings, uuid, state.recorded), state.array, f"RAID0 {path} is assembled")
    if uuid is not None and all(m.fstype == RAID_MEMBER and _ours(m, name) for m in members):
        assemble = Step(
            "assemble-array",
            path,
            ("mdadm", "--assemble", path, *(m.path for m in members)),
            f"reassemble RAID0 {path} from {len(members)} disks",
        )
        return _Layout([assemble, *_record(settings, uuid, state.recorded)], None, f"reassembling {path}")
    refused = [m for m in members if not (m.blank or _ours(m, name))]
    if refused and not settings.force:
        refusal = f"it carries {refused[0].describe()}; --model-cache-force puts it into the cache's array"
        raise CacheError("create-array", refused[0].path, refusal)
    # --run: no question about members that look used; the refusal above already decided.
    create_argv = ("mdadm", "--create", path, "--run", "--level=0", f"--raid-devices={len(members)}")
    create = Step(
        "create-array",
        path,
        (*create_argv, "--metadata=1.2", f"--name={name}", *(m.path for m in members)),
        f"create RAID0 {path} from {len(members)} disks",
    )
    steps = [_wipe(m.path) for m in members if not m.blank] + [create, *_record(settings, None, None)]
    if state.recorded and all(m.blank for m in members):
        reason = f"the disks of the recorded array {path} came back blank (the instance was stopped): recreating it"
    else:
        reason = f"creating RAID0 {path} from {len(members)} disks"
    return _Layout(steps, Disk(path=path, real=path), reason)


def _record(settings: CacheSettings, uuid: str | None, recorded: str | None) -> list[Step]:
    """Steps that record the array's configuration, unless it is recorded already."""
    if uuid is not None and _hex(uuid) in recorded_uuids(recorded or ""):
        return []
    state_dir, path = str(settings.state_dir), settings.array_path
    return [
        Step("mkdir", state_dir, ("mkdir", "-p", state_dir), f"create {state_dir}"),
        Step(
            "record-array",
            path,
            ("mdadm", "--detail", "--brief", path),
            f"record {path} in {settings.record_path} so that a reboot reassembles it",
            stdout_to=settings.record_path,
        ),
    ]


def _wipe(device: str) -> Step:
    return Step("wipe", device, ("wipefs", "--all", device), f"erase the signatures on {device}")


def _mkfs(device: str, fs: str, *, overwrite: bool) -> Step:
    if fs == "xfs":  # -K: instance-store disks come zeroed, discarding them first only costs time
        argv = ("mkfs.xfs", "-K", "-L", LABEL, *(("-f",) if overwrite else ()), device)
    else:
        options = ("-E", "nodiscard,lazy_itable_init=1", "-m", "0", "-L", LABEL)
        argv = ("mkfs.ext4", *options, *(("-F",) if overwrite else ()), device)
    return Step("format", device, argv, f"format {device} as {fs} labelled {LABEL}")


def _plan_mount(target: Disk, settings: CacheSettings) -> list[Step]:
    path = str(settings.path)
    return [
        Step("mkdir", path, ("mkdir", "-p", path), f"create {path}"),
        Step("mount", target.path, ("mount", "-o", "noatime", target.path, path), f"mount {target.path} at {path}"),
    ]


# The node ---------------------------------------------------------------------------------------------------------


class Outcome(Enum):
    READY = "ready"  # mounted: label the node and remove the startup taint
    ABSENT = "absent"  # no cache on this node (no disks, or disabled): nothing to wait for, no label
    FAILED = "failed"  # the startup taint stays; a label left from an earlier boot would lie


def plan_node_update(
    node: Mapping[str, Any], outcome: Outcome, *, wait_for_models: bool = False
) -> dict[str, Any] | None:
    """A merge patch guarded by resourceVersion; None if the node is as it should be.

    ``spec.taints`` is an atomic list in Kubernetes: the patch carries it whole, every other taint kept. With
    ``wait_for_models`` a node with a cache whose annotation names models keeps the startup taint: the prefetch
    removes it once they are all ready (a node without a cache prefetches nothing, so it has nothing to wait for).
    """
    labels = (node.get("metadata") or {}).get("labels") or {}
    taints = [t for t in (node.get("spec") or {}).get("taints") or [] if isinstance(t, dict)]
    wanted = "ready" if outcome is Outcome.READY else None
    metadata: dict[str, Any] = {"resourceVersion": node["metadata"]["resourceVersion"]}
    if labels.get(READY_LABEL) != wanted:
        metadata["labels"] = {READY_LABEL: wanted}
    patch: dict[str, Any] = {"metadata": metadata}
    release = outcome is Outcome.ABSENT or (outcome is Outcome.READY and not (wait_for_models and names_models(node)))
    if release and any(t.get("key") == PENDING_TAINT for t in taints):
        patch["spec"] = {"taints": [t for t in taints if t.get("key") != PENDING_TAINT] or None}
    return patch if len(metadata) > 1 or "spec" in patch else None


# Parsers of what probing reads ------------------------------------------------------------------------------------


def parse_blkid(text: str) -> dict[str, str]:
    """``blkid -o export`` output: ``KEY=value`` lines, special characters escaped with a backslash."""
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {key.strip(): re.sub(r"\\(.)", r"\1", value) for key, value in pairs if key.strip()}


def parse_mountinfo(text: str, mount_point: str) -> Mounted | None:
    """What is mounted at ``mount_point`` according to ``/proc/self/mountinfo`` (proc(5)), None if nothing is.

    Mounts stack at one point (the kubelet's bind of the hostPath, the cache mounted over it). A path lookup reaches
    the topmost: the one no other mount at that point sits on (names as its parent), wherever it is listed.
    """
    stack: dict[str, tuple[str, Mounted]] = {}  # mount ID -> (parent ID, the mount)
    for line in text.splitlines():
        fields = line.split(" ")
        if "-" not in fields[6:]:
            continue
        separator = fields.index("-", 6)
        if len(fields) < separator + 3 or _unoctal(fields[4]) != mount_point:
            continue
        shared = any(tag.startswith("shared:") for tag in fields[6:separator])
        source, fstype, root = _unoctal(fields[separator + 2]), fields[separator + 1], _unoctal(fields[3])
        stack[fields[0]] = (fields[1], Mounted(source=source, fstype=fstype, root=root, shared=shared))
    parents = {parent for parent, _ in stack.values()}
    tops = [mount for mount_id, (_, mount) in stack.items() if mount_id not in parents]
    listed = tops or [mount for _, mount in stack.values()]  # a loop of parents: only a corrupt table has one
    return listed[-1] if listed else None


def _unoctal(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def recorded_uuids(text: str) -> set[str]:
    """Array UUIDs in mdadm.conf lines, as bare lower-case hex (mdadm writes ``a:b:c:d``, blkid ``8-4-4-4-12``)."""
    return {_hex(u) for u in re.findall(r"UUID=([0-9A-Fa-f:.-]+)", text)}


def _hex(uuid: str) -> str:
    return re.sub(r"[^0-9a-f]", "", uuid.lower())
