"""The model cache on real block devices: sparse files on loop devices, mounted under the test's own directory."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from agent.cache.disks import Completed, RecordingRunner, discover, execute, select_devices
from agent.cache.plan import (
    PENDING_TAINT,
    READY_LABEL,
    CacheError,
    Disk,
    Outcome,
    ProbeState,
    parse_blkid,
    parse_mountinfo,
    plan_cache,
)
from agent.cache.run import CacheMetrics, prepare_cache
from agent.cache.settings import CacheSettings
from agent.drain.nodes import KubeActions, api_client
from simulate.fakes.kube import FakeKube
from spotdrain.metrics import CollectorRegistry
from spotdrain.ratelimit import RateLimiter

SIZE = 300 * 1024 * 1024  # mkfs.xfs wants at least 300 MB
NODE = "gpu-1"
PENDING = {"key": PENDING_TAINT, "effect": "NoSchedule"}

# The package of each tool these tests run (the code under test runs mkfs, wipefs and mdadm from PATH too).
PACKAGES = {
    "losetup": "util-linux",
    "blkid": "util-linux",
    "findmnt": "util-linux",
    "wipefs": "util-linux",
    "mount": "mount",
    "umount": "mount",
    "mkfs.xfs": "xfsprogs",
    "mkfs.ext4": "e2fsprogs",
    "mdadm": "mdadm",
    "unshare": "util-linux",
}


def _missing(*tools: str) -> list[str]:
    return [f"{tool} ({PACKAGES[tool]})" for tool in tools if shutil.which(tool) is None]


def needs(*tools: str) -> pytest.MarkDecorator:
    """Skip, naming what is missing, unless every one of ``tools`` is on PATH."""
    missing = _missing(*tools)
    return pytest.mark.skipif(bool(missing), reason=f"not on PATH: {', '.join(missing)}")


_LOOP_MISSING = (["root"] if os.geteuid() != 0 else []) + _missing("losetup", "blkid", "findmnt", "mount", "umount")
needs_loop = pytest.mark.skipif(
    bool(_LOOP_MISSING), reason=f"loop devices and mounts need root and their tools; missing {', '.join(_LOOP_MISSING)}"
)
FILESYSTEMS = [pytest.param("xfs", marks=needs("mkfs.xfs")), pytest.param("ext4", marks=needs("mkfs.ext4"))]


def sh(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def quietly(*argv: str) -> None:
    subprocess.run(argv, capture_output=True)


def mounted_at(path: Path) -> str | None:
    found = parse_mountinfo(Path("/proc/self/mountinfo").read_text(), str(path))
    return found.source if found else None


def mount_options(path: Path) -> set[str]:
    return set(sh("findmnt", "-n", "-o", "OPTIONS", "--mountpoint", str(path)).split(","))


def signature(device: str) -> dict[str, str]:
    result = subprocess.run(["blkid", "-p", "-o", "export", device], capture_output=True, text=True)
    return parse_blkid(result.stdout)


@pytest.fixture
def loops(tmp_path: Path) -> Iterator[Callable[[int], list[str]]]:
    """Attach ``count`` sparse files as loop devices; unmounts the cache path and detaches them all at the end."""
    attached: list[str] = []

    def attach(count: int = 1) -> list[str]:
        for _ in range(count):
            image = tmp_path / f"disk{len(attached)}.img"
            with image.open("wb") as file:
                file.truncate(SIZE)
            attached.append(sh("losetup", "--find", "--show", str(image)))
        return attached[-count:]

    try:
        yield attach
    finally:
        while mounted_at(tmp_path / "cache") is not None:
            subprocess.run(["umount", str(tmp_path / "cache")], check=True)
        for device in attached:
            quietly("losetup", "-d", device)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.add_node(NODE, taints=[PENDING])
        yield kube


@pytest.fixture
async def actions(kube: FakeKube, tmp_path: Path) -> AsyncIterator[KubeActions]:
    async with api_client(str(kube.write_kubeconfig(tmp_path / "kubeconfig"))) as api:
        yield KubeActions(api, limiter=RateLimiter(qps=100, burst=100), on_error=lambda _: None)


def settings_for(tmp_path: Path, devices: list[str], *, fs: str = "xfs", force: bool = False) -> CacheSettings:
    return CacheSettings(
        enabled=True,
        devices=",".join(devices),
        fs=fs,
        path=tmp_path / "cache",
        force=force,
        state_dir=tmp_path / "state",
        name="model-cache",
    )


def node_state(kube: FakeKube) -> tuple[str | None, list[str]]:
    node = kube.node(NODE)
    taints = [t["key"] for t in node["spec"].get("taints") or []]
    return node["metadata"].get("labels", {}).get(READY_LABEL), taints


@needs_loop
@pytest.mark.parametrize("fs", FILESYSTEMS)
async def test_a_first_run_formats_mounts_labels_the_node_and_removes_the_taint(
    loops: Callable[[int], list[str]], kube: FakeKube, actions: KubeActions, tmp_path: Path, fs: str
) -> None:
    [device] = loops(1)
    runner, registry = RecordingRunner(), CollectorRegistry()
    settings = settings_for(tmp_path, [device], fs=fs)
    result = await prepare_cache(
        settings, actions, node_name=NODE, metrics=CacheMetrics.create(registry), runner=runner
    )
    assert (result.outcome, result.device, result.node_changed) == (Outcome.READY, device, True)
    assert [c[0] for c in runner.commands if c[0] != "blkid"] == [f"mkfs.{fs}", "mkdir", "mount"]
    assert signature(device)["LABEL"] == "model-cache"
    assert mounted_at(settings.path) == device
    assert "noatime" in mount_options(settings.path)
    assert node_state(kube) == ("ready", [])
    assert registry.get_sample_value("spotdrain_model_cache_ready") == 1
    assert (registry.get_sample_value("spotdrain_model_cache_size_bytes") or 0) > 200 * 1024 * 1024


@needs_loop
@needs("mkfs.xfs")
async def test_a_second_run_on_a_ready_node_changes_nothing(
    loops: Callable[[int], list[str]], kube: FakeKube, actions: KubeActions, tmp_path: Path
) -> None:
    settings = settings_for(tmp_path, loops(1))
    await prepare_cache(settings, actions, node_name=NODE, metrics=None)
    (settings.path / "weights.bin").write_bytes(b"layers")
    patches = kube.count("PATCH", "/api/v1/nodes/{name}")
    runner = RecordingRunner()
    result = await prepare_cache(settings, actions, node_name=NODE, metrics=None, runner=runner)
    assert (result.outcome, result.steps, result.node_changed) == (Outcome.READY, (), False)
    assert {c[0] for c in runner.commands} == {"blkid"}
    assert kube.count("PATCH", "/api/v1/nodes/{name}") == patches
    assert (settings.path / "weights.bin").read_bytes() == b"layers"


@needs_loop
@pytest.mark.parametrize("fs", FILESYSTEMS)
async def test_after_a_reboot_the_cache_is_mounted_again_without_formatting(
    loops: Callable[[int], list[str]], tmp_path: Path, fs: str
) -> None:
    settings = settings_for(tmp_path, loops(1), fs=fs)
    await prepare_cache(settings, None, node_name=None, metrics=None)
    (settings.path / "weights.bin").write_bytes(b"layers")
    sh("umount", str(settings.path))
    runner = RecordingRunner()
    result = await prepare_cache(settings, None, node_name=None, metrics=None, runner=runner)
    assert [s.action for s in result.steps] == ["mkdir", "mount"]
    assert not runner.ran(f"mkfs.{fs}")
    assert (settings.path / "weights.bin").read_bytes() == b"layers"


@needs_loop
@needs("mkfs.ext4")
async def test_a_foreign_filesystem_is_refused_by_name_and_the_taint_left(
    loops: Callable[[int], list[str]], kube: FakeKube, actions: KubeActions, tmp_path: Path
) -> None:
    [device] = loops(1)
    sh("mkfs.ext4", "-q", "-L", "data", device)
    with pytest.raises(CacheError, match="--model-cache-force") as caught:
        await prepare_cache(settings_for(tmp_path, [device]), actions, node_name=NODE, metrics=None)
    assert (caught.value.step, caught.value.device) == ("format", device)
    assert signature(device)["LABEL"] == "data"
    assert node_state(kube) == (None, [PENDING_TAINT])


@needs_loop
@needs("mkfs.ext4", "wipefs")
async def test_force_formats_a_foreign_filesystem(loops: Callable[[int], list[str]], tmp_path: Path) -> None:
    [device] = loops(1)
    sh("mkfs.ext4", "-q", "-L", "data", device)
    settings = settings_for(tmp_path, [device], fs="ext4", force=True)
    result = await prepare_cache(settings, None, node_name=None, metrics=None)
    assert [s.action for s in result.steps][:2] == ["wipe", "format"]
    assert (signature(device)["TYPE"], signature(device)["LABEL"]) == ("ext4", "model-cache")


@needs_loop
async def test_a_device_that_disappeared_fails_naming_it(loops: Callable[[int], list[str]], tmp_path: Path) -> None:
    [device] = loops(1)
    sh("losetup", "-d", device)
    with pytest.raises(CacheError, match="no media") as caught:
        await prepare_cache(settings_for(tmp_path, [device]), None, node_name=None, metrics=None)
    assert (caught.value.step, caught.value.device) == ("probe", device)


async def test_a_missing_device_path_fails_naming_it(tmp_path: Path) -> None:
    missing = str(tmp_path / "nvme9n1")
    with pytest.raises(CacheError, match="No such file") as caught:
        await prepare_cache(settings_for(tmp_path, [missing]), None, node_name=None, metrics=None)
    assert (caught.value.step, caught.value.device) == ("probe", missing)


@needs_loop
@needs("mdadm", "mkfs.xfs")
@pytest.mark.skipif(not Path("/proc/mdstat").exists(), reason="RAID0 needs the kernel's md driver (/proc/mdstat)")
async def test_several_disks_become_a_raid0_that_a_reboot_reassembles(
    loops: Callable[[int], list[str]], tmp_path: Path
) -> None:
    settings = dataclasses.replace(settings_for(tmp_path, loops(2)), name=f"sd-test-{os.getpid()}")
    try:
        result = await prepare_cache(settings, None, node_name=None, metrics=None)
        assert result.device == settings.array_path
        assert "UUID=" in Path(settings.record_path).read_text()
        sh("umount", str(settings.path))
        sh("mdadm", "--stop", settings.array_path)
        again = await prepare_cache(settings, None, node_name=None, metrics=None)
        assert [s.action for s in again.steps] == ["assemble-array", "mkdir", "mount"]
    finally:
        quietly("umount", str(settings.path))
        quietly("mdadm", "--stop", settings.array_path)


async def test_the_array_is_recorded_from_what_mdadm_prints(tmp_path: Path) -> None:
    record = "ARRAY /dev/md/model-cache metadata=1.2 name=host:model-cache UUID=3aaa0122:29827cfa:5331ad66:ca767371\n"
    runner = RecordingRunner(answers={"mdadm": Completed((), 0, record, "")})
    disks = {p: Disk(path=p, real=p) for p in ("/dev/nvme1n1", "/dev/nvme2n1")}
    plan = plan_cache(list(disks), ProbeState(disks=disks), settings_for(tmp_path, []))
    for step in plan.steps[:3]:
        await execute(step, runner)
    assert [c[:2] for c in runner.ran("mdadm")] == [("mdadm", "--create"), ("mdadm", "--detail")]
    assert (tmp_path / "state/mdadm.conf").read_text() == record


async def test_a_failed_command_reports_its_step_device_and_stderr(tmp_path: Path) -> None:
    busy = "mdadm: cannot open /dev/nvme2n1: Device or resource busy"
    runner = RecordingRunner(answers={"mdadm": Completed((), 1, "", busy + "\n")})
    disks = {p: Disk(path=p, real=p) for p in ("/dev/nvme1n1", "/dev/nvme2n1")}
    create = plan_cache(list(disks), ProbeState(disks=disks), settings_for(tmp_path, [])).steps[0]
    with pytest.raises(CacheError) as caught:
        await execute(create, runner)
    assert (caught.value.step, caught.value.device, caught.value.output) == (
        "create-array",
        "/dev/md/model-cache",
        busy,
    )


# Discovery, on a fake /dev and /sys -------------------------------------------------------------------------------


def fake_disk(root: Path, name: str, model: str, by_id: str | None) -> None:
    (root / "dev" / name).touch()
    (root / "sys/block" / name / "device").mkdir(parents=True)
    (root / "sys/block" / name / "device/model").write_text(model.ljust(40) + "\n")
    if by_id is not None:
        (root / "dev/disk/by-id" / by_id).symlink_to(f"../../{name}")


def test_discovery_finds_instance_store_disks_and_never_ebs_volumes(tmp_path: Path) -> None:
    (tmp_path / "dev/disk/by-id").mkdir(parents=True)
    fake_disk(tmp_path, "nvme0n1", "Amazon Elastic Block Store", "nvme-Amazon_Elastic_Block_Store_vol0123")
    fake_disk(tmp_path, "nvme2n1", "Amazon EC2 NVMe Instance Storage", "nvme-Amazon_EC2_NVMe_Instance_Storage_AWS2")
    fake_disk(tmp_path, "nvme10n1", "Amazon EC2 NVMe Instance Storage", None)  # found through sysfs alone
    fake_disk(tmp_path, "nvme1n1", "Amazon EC2 NVMe Instance Storage", "nvme-Amazon_EC2_NVMe_Instance_Storage_AWS1")
    (tmp_path / "dev/nvme1n1p1").touch()
    (tmp_path / "dev/disk/by-id/nvme-Amazon_EC2_NVMe_Instance_Storage_AWS1-part1").symlink_to("../../nvme1n1p1")
    assert discover(tmp_path) == ["/dev/nvme1n1", "/dev/nvme2n1", "/dev/nvme10n1"]


def test_a_device_glob_replaces_discovery(tmp_path: Path) -> None:
    for name in ("loop10", "loop2", "other"):
        (tmp_path / name).touch()
    settings = dataclasses.replace(settings_for(tmp_path, []), devices=str(tmp_path / "loop*"), root=tmp_path)
    assert select_devices(settings) == [str(tmp_path / "loop2"), str(tmp_path / "loop10")]
