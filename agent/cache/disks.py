"""The NVMe model cache on a node: find the instance-store disks, bring them to a mounted filesystem, tell the cluster.

``prepare_cache`` probes, plans (``agent.cache.plan``), runs the planned commands through a ``Runner`` and probes
again until the plan is empty, then labels the node ``spotdrain.io/model-cache=ready`` and removes the startup taint.
A failed step raises ``CacheError`` and leaves the taint in place.

Mount propagation: the cache is mounted with a plain ``mount`` at the cache path inside the agent's container, over
the kubelet's bind of the host directory (so the path is always a mount there; ``plan_cache`` tells that bind, a
directory, from a filesystem). The DaemonSet mounts the host directory with ``mountPropagation: Bidirectional`` (which
needs a privileged container): the runtime binds it ``rshared``, in the host directory's peer group, so the mount
reaches the host, and pods that mount the same hostPath with ``HostToContainer`` see it, including a cache mounted
after they started. A bind that is not shared is refused before anything is written. A restarted container gets the
host directory bound again, the cache on it: nothing is planned. ``mount --make-shared`` on the cache path is not
used: it would only change how mounts made later *under* the cache propagate, and when run outside a container it
would change the host's own tree. The container also needs the host's ``/dev`` (a hostPath), so that devices created
after it started (``/dev/md*``) appear.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from agent.cache.plan import (
    CacheError,
    Disk,
    Outcome,
    Plan,
    ProbeState,
    Step,
    parse_blkid,
    parse_mountinfo,
    plan_cache,
    plan_node_update,
)
from agent.cache.settings import CacheSettings
from agent.drain.nodes import NodeActions
from spotdrain.retry import ApiError, retrying

log = structlog.get_logger()

INSTANCE_STORE_MODEL = "Amazon EC2 NVMe Instance Storage"
MAX_ROUNDS = 4  # create, format and mount; probe; a reassembly takes one more round


@dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    async def run(self, argv: Sequence[str]) -> Completed: ...


class ProcessRunner:
    """Runs commands as child processes, stdin closed so that no tool waits for an answer."""

    async def run(self, argv: Sequence[str]) -> Completed:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except OSError as error:
            return Completed(tuple(argv), 127, "", f"{argv[0]}: {error.strerror or error}")
        out, err = await process.communicate()
        return Completed(
            tuple(argv), process.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")
        )


class RecordingRunner:
    """Records every command; runs it through ``inner``, or answers from ``answers`` (by program) when given."""

    def __init__(self, inner: Runner | None = None, *, answers: dict[str, Completed] | None = None) -> None:
        self.inner = inner or ProcessRunner()
        self.answers = answers or {}
        self.commands: list[tuple[str, ...]] = []

    async def run(self, argv: Sequence[str]) -> Completed:
        self.commands.append(tuple(argv))
        if argv[0] in self.answers:
            return dataclasses.replace(self.answers[argv[0]], argv=tuple(argv))
        return await self.inner.run(argv)

    def ran(self, program: str) -> list[tuple[str, ...]]:
        return [c for c in self.commands if c[0] == program]


# Discovery --------------------------------------------------------------------------------------------------------


def _natural(path: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def discover(root: Path = Path("/")) -> list[str]:
    """Instance-store NVMe disks (never EBS volumes), from /dev/disk/by-id names and sysfs models, under ``root``."""
    found: set[str] = set()
    for link in (root / "dev/disk/by-id").glob("*NVMe_Instance_Storage_*"):
        target = link.resolve()
        if re.search(r"-part\d+$", link.name) is None and target.is_relative_to(root.resolve()):
            found.add("/" + str(target.relative_to(root.resolve())))
    for model in (root / "sys/block").glob("nvme*n*/device/model"):
        if model.read_text(errors="replace").strip() == INSTANCE_STORE_MODEL:
            found.add(f"/dev/{model.parent.parent.name}")
    return sorted(found, key=_natural)


def select_devices(settings: CacheSettings) -> list[str]:
    """``--model-cache-devices`` (a glob, or a comma list taken as it is) or, without it, discovery."""
    if settings.devices is None:
        return discover(settings.root)
    if any(c in settings.devices for c in "*?["):
        return sorted(glob.glob(settings.devices), key=_natural)
    return [d.strip() for d in settings.devices.split(",") if d.strip()]


# Probing ----------------------------------------------------------------------------------------------------------


def _check_device(path: str) -> None:
    try:
        if not stat.S_ISBLK(os.stat(path).st_mode):
            raise CacheError("probe", path, "not a block device")
        with open(path, "rb") as device:
            size = device.seek(0, os.SEEK_END)
    except OSError as error:
        raise CacheError("probe", path, error.strerror or str(error)) from None
    if size == 0:
        raise CacheError("probe", path, "the device has no media (size 0): detached or gone")


async def probe_disk(path: str, runner: Runner) -> Disk:
    """The device's signature, read by ``blkid -p`` (the low-level probe: no cache that could be stale)."""
    _check_device(path)
    result = await runner.run(("blkid", "-p", "-o", "export", path))
    if result.returncode not in (0, 2):  # 2: no signature at all
        raise CacheError("probe", path, (result.stderr or result.stdout).strip() or f"blkid exit {result.returncode}")
    tags = parse_blkid(result.stdout) if result.returncode == 0 else {}
    return Disk(
        path=path,
        real=os.path.realpath(path),
        fstype=tags.get("TYPE"),
        label=tags.get("LABEL"),
        uuid=tags.get("UUID"),
        ptable=tags.get("PTTYPE"),
    )


async def probe(devices: Sequence[str], settings: CacheSettings, runner: Runner) -> ProbeState:
    disks = {d: await probe_disk(d, runner) for d in devices}
    array_exists = len(devices) > 1 and os.path.exists(settings.array_path)
    record = Path(settings.record_path)
    return ProbeState(
        disks=disks,
        mounted=parse_mountinfo(Path("/proc/self/mountinfo").read_text(), os.path.realpath(settings.path)),
        array=await probe_disk(settings.array_path, runner) if array_exists else None,
        recorded=record.read_text() if record.is_file() else None,
    )


# Running the plan -------------------------------------------------------------------------------------------------


async def execute(step: Step, runner: Runner) -> None:
    log.info("cache.step", action=step.action, device=step.device, description=step.description)
    result = await runner.run(step.argv)
    if result.returncode != 0:
        output = (result.stderr or result.stdout).strip() or f"{step.argv[0]} exited {result.returncode}"
        raise CacheError(step.action, step.device, output)
    if step.stdout_to is not None:
        target = Path(step.stdout_to)
        partial = target.with_name(target.name + ".partial")
        partial.write_text(result.stdout)
        partial.replace(target)  # a crash mid-write must not leave half a record


@dataclass(frozen=True)
class Prepared:
    plan: Plan  # the last, empty plan: its target is mounted (None: no cache here)
    steps: tuple[Step, ...]  # every step run, in order


async def prepare_disks(devices: Sequence[str], settings: CacheSettings, runner: Runner) -> Prepared:
    """Probe, plan and run until the plan is empty; returns once the cache is mounted or there is nothing to do."""
    ran: list[Step] = []
    for _ in range(MAX_ROUNDS):
        plan = plan_cache(devices, await probe(devices, settings, runner), settings)
        if not plan.steps:
            return Prepared(plan, tuple(ran))
        log.info("cache.plan", reason=plan.reason, steps=[s.action for s in plan.steps])
        for step in plan.steps:
            await execute(step, runner)
            ran.append(step)
    device = ", ".join(devices)
    raise CacheError("settle", device, f"still planning {[s.action for s in plan.steps]} after {MAX_ROUNDS} rounds")


# The node ---------------------------------------------------------------------------------------------------------


async def update_node(actions: NodeActions, name: str, outcome: Outcome, *, wait_for_models: bool = False) -> bool:
    """Label and untaint (or not) the node in one guarded patch; True if it changed. Conflicts re-read the node."""

    async def attempt() -> bool:
        node = await actions.get_node(name)
        if node is None:
            raise ApiError(404, f"node {name} not found")
        patch = plan_node_update(node, outcome, wait_for_models=wait_for_models)
        if patch is None:
            return False
        await actions.patch_node(name, patch)
        return True

    try:
        changed = await retrying(attempt, what="cache.node_update")
    except ApiError as error:
        raise CacheError("node update", name, str(error)) from None
    log.info("cache.node_updated" if changed else "cache.node_unchanged", node=name, outcome=outcome.value)
    return changed
