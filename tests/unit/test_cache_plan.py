from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.cache.models import MODELS_ANNOTATION
from agent.cache.plan import (
    NOTHING_TO_DO,
    PENDING_TAINT,
    READY_LABEL,
    CacheError,
    Disk,
    Mounted,
    Outcome,
    ProbeState,
    parse_blkid,
    parse_mountinfo,
    plan_cache,
    plan_node_update,
    recorded_uuids,
)
from agent.cache.settings import CacheSettings, command_from_arguments
from simulate.fakes.kube_patch import merge_patch
from spotdrain.cli import build_parser
from spotdrain.settings import SettingsError

SETTINGS = CacheSettings(
    enabled=True,
    devices=None,
    fs="xfs",
    path=Path("/mnt/model-cache"),
    force=False,
    state_dir=Path("/var/lib/spotdrain"),
    name="model-cache",
)
FORCED = dataclasses.replace(SETTINGS, force=True)
ARRAY = "/dev/md/model-cache"
NVME = ["/dev/nvme1n1", "/dev/nvme2n1"]
ARRAY_UUID_BLKID = "3aaa0122-2982-7cfa-5331-ad66ca767371"
RECORD = "ARRAY /dev/md/model-cache metadata=1.2 name=ip-10-0-0-1:model-cache UUID=3aaa0122:29827cfa:5331ad66:ca767371"


def disk(path: str, fstype: str | None = None, label: str | None = None, **more: Any) -> Disk:
    return Disk(path=path, real=path, fstype=fstype, label=label, **more)


def member(path: str) -> Disk:
    return disk(path, "linux_raid_member", "ip-10-0-0-1:model-cache", uuid=ARRAY_UUID_BLKID)


def state(*disks: Disk, **more: Any) -> ProbeState:
    return ProbeState(disks={d.path: d for d in disks}, **more)


def test_a_node_without_instance_store_disks_plans_nothing_and_says_why() -> None:
    plan = plan_cache([], state(), SETTINGS)
    assert (plan.steps, plan.reason, plan.target) == ((), NOTHING_TO_DO, None)


def test_a_blank_disk_is_formatted_as_xfs_without_discard_and_mounted_noatime() -> None:
    plan = plan_cache(NVME[:1], state(disk(NVME[0])), SETTINGS)
    assert [s.argv for s in plan.steps] == [
        ("mkfs.xfs", "-K", "-L", "model-cache", "/dev/nvme1n1"),
        ("mkdir", "-p", "/mnt/model-cache"),
        ("mount", "-o", "noatime", "/dev/nvme1n1", "/mnt/model-cache"),
    ]
    assert plan.target == "/dev/nvme1n1"


def test_ext4_is_formatted_without_discard_lazily_and_without_reserved_blocks() -> None:
    plan = plan_cache(NVME[:1], state(disk(NVME[0])), dataclasses.replace(SETTINGS, fs="ext4"))
    assert plan.steps[0].argv == (
        "mkfs.ext4",
        *("-E", "nodiscard,lazy_itable_init=1", "-m", "0", "-L", "model-cache"),
        "/dev/nvme1n1",
    )


def test_a_disk_with_the_cache_label_is_mounted_without_formatting_after_a_reboot() -> None:
    plan = plan_cache(NVME[:1], state(disk(NVME[0], "ext4", "model-cache")), SETTINGS)
    assert [s.action for s in plan.steps] == ["mkdir", "mount"]


def test_a_mounted_cache_plans_nothing() -> None:
    mounted = Mounted(source="/dev/nvme1n1", fstype="xfs")
    plan = plan_cache(NVME[:1], state(disk(NVME[0], "xfs", "model-cache"), mounted=mounted), SETTINGS)
    assert plan.steps == ()
    assert plan.target == "/dev/nvme1n1"


def test_a_cache_path_mounted_from_another_device_is_refused() -> None:
    mounted = Mounted(source="/dev/nvme9n1", fstype="ext4")
    with pytest.raises(CacheError, match="already mounted from /dev/nvme9n1") as caught:
        plan_cache(NVME[:1], state(disk(NVME[0], "xfs", "model-cache"), mounted=mounted), SETTINGS)
    assert (caught.value.step, caught.value.device) == ("mount", "/mnt/model-cache")


@pytest.mark.parametrize(
    ("found", "described"),
    [(disk(NVME[0], "ext4", "data"), "ext4 (label 'data')"), (disk(NVME[0], ptable="gpt"), "a gpt partition table")],
)
def test_foreign_data_is_refused_naming_the_device_what_it_carries_and_the_flag(found: Disk, described: str) -> None:
    with pytest.raises(CacheError) as caught:
        plan_cache(NVME[:1], state(found), SETTINGS)
    assert (caught.value.step, caught.value.device) == ("format", "/dev/nvme1n1")
    assert f"it carries {described}" in str(caught.value)
    assert "--model-cache-force" in str(caught.value)


def test_force_wipes_and_formats_a_foreign_filesystem() -> None:
    plan = plan_cache(NVME[:1], state(disk(NVME[0], "ext4", "data")), FORCED)
    assert [s.argv for s in plan.steps[:2]] == [
        ("wipefs", "--all", "/dev/nvme1n1"),
        ("mkfs.xfs", "-K", "-L", "model-cache", "-f", "/dev/nvme1n1"),
    ]


def test_several_blank_disks_become_a_recorded_raid0_array_with_one_filesystem() -> None:
    plan = plan_cache(NVME, state(disk(NVME[0]), disk(NVME[1])), SETTINGS)
    create, mkdir, record, mkfs, _, mount = plan.steps
    assert create.argv == (
        *("mdadm", "--create", ARRAY, "--run", "--level=0", "--raid-devices=2", "--metadata=1.2"),
        *("--name=model-cache", *NVME),
    )
    assert mkdir.argv == ("mkdir", "-p", "/var/lib/spotdrain")
    assert record.argv == ("mdadm", "--detail", "--brief", ARRAY)
    assert record.stdout_to == "/var/lib/spotdrain/mdadm.conf"
    assert mkfs.argv == ("mkfs.xfs", "-K", "-L", "model-cache", ARRAY)
    assert mount.argv == ("mount", "-o", "noatime", ARRAY, "/mnt/model-cache")
    assert plan.target == ARRAY


def test_members_of_the_recorded_array_are_reassembled_alone_then_probed_again() -> None:
    plan = plan_cache(NVME, state(member(NVME[0]), member(NVME[1]), recorded=RECORD), SETTINGS)
    assert [s.argv for s in plan.steps] == [("mdadm", "--assemble", ARRAY, *NVME)]
    assert plan.target == ARRAY


def test_an_assembled_array_is_mounted_and_its_missing_record_written() -> None:
    array = dataclasses.replace(disk(ARRAY, "xfs", "model-cache"), real="/dev/md127")
    plan = plan_cache(NVME, state(member(NVME[0]), member(NVME[1]), array=array), SETTINGS)
    assert [s.action for s in plan.steps] == ["mkdir", "record-array", "mkdir", "mount"]


def test_an_assembled_recorded_and_mounted_array_plans_nothing() -> None:
    array = dataclasses.replace(disk(ARRAY, "xfs", "model-cache"), real="/dev/md127")
    mounted = Mounted(source="/dev/md127", fstype="xfs")
    probed = state(member(NVME[0]), member(NVME[1]), array=array, recorded=RECORD, mounted=mounted)
    assert plan_cache(NVME, probed, SETTINGS).steps == ()


def test_a_recorded_array_whose_disks_came_back_blank_is_recreated() -> None:
    plan = plan_cache(NVME, state(disk(NVME[0]), disk(NVME[1]), recorded=RECORD), SETTINGS)
    assert plan.steps[0].action == "create-array"
    assert "came back blank" in plan.reason


def test_a_foreign_disk_among_several_is_refused_by_name_unless_forced() -> None:
    probed = state(disk(NVME[0]), disk(NVME[1], "xfs", "scratch"))
    with pytest.raises(CacheError) as caught:
        plan_cache(NVME, probed, SETTINGS)
    assert (caught.value.step, caught.value.device) == ("create-array", "/dev/nvme2n1")
    forced = plan_cache(NVME, probed, FORCED)
    assert forced.steps[0].argv == ("wipefs", "--all", "/dev/nvme2n1")
    assert forced.steps[1].action == "create-array"


def test_an_array_left_half_assembled_from_an_older_layout_is_rebuilt_from_its_own_members() -> None:
    probed = state(member(NVME[0]), disk(NVME[1]))
    assert [s.action for s in plan_cache(NVME, probed, SETTINGS).steps][:2] == ["wipe", "create-array"]


FSTYPES = st.sampled_from([None, "xfs", "ext4", "linux_raid_member", "vfat"])
LABELS = st.sampled_from([None, "model-cache", "data", "host:model-cache", "model-cache-2"])


@given(fstype=FSTYPES, label=LABELS, ptable=st.sampled_from([None, "gpt"]), count=st.integers(1, 3))
def test_no_plan_writes_to_a_disk_with_foreign_data_unless_forced(
    fstype: str | None, label: str | None, ptable: str | None, count: int
) -> None:
    paths = [f"/dev/nvme{i}n1" for i in range(1, count + 1)]
    suspect = disk(paths[0], fstype, label, ptable=ptable)
    ours = ptable is None and (
        label in ("host:model-cache", "model-cache") if fstype == "linux_raid_member" else label == "model-cache"
    )
    refused: CacheError | None = None
    try:
        plan = plan_cache(paths, state(suspect, *(disk(p) for p in paths[1:])), SETTINGS)
    except CacheError as error:
        refused = error
    if refused is not None:
        assert (refused.device, suspect.blank, ours) == (suspect.path, False, False)
        return
    writes = {"wipe", "format", "create-array"}
    touched = [s for s in plan.steps if s.action in writes and suspect.path in s.argv]
    assert suspect.blank or ours or not touched


# The node ---------------------------------------------------------------------------------------------------------


def node(*, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "gpu-1", "resourceVersion": "41", "labels": labels or {}}, "spec": {"taints": taints}}


GPU_TAINT = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
PENDING = {"key": PENDING_TAINT, "effect": "NoSchedule"}


def test_a_ready_cache_labels_the_node_and_removes_only_the_startup_taint_in_one_guarded_patch() -> None:
    before = node(taints=[GPU_TAINT, PENDING])
    patch = plan_node_update(before, Outcome.READY)
    assert patch == {
        "metadata": {"resourceVersion": "41", "labels": {READY_LABEL: "ready"}},
        "spec": {"taints": [GPU_TAINT]},
    }
    after = merge_patch(before, patch)
    assert after["metadata"]["labels"] == {READY_LABEL: "ready"}
    assert after["spec"]["taints"] == [GPU_TAINT]


def test_a_node_already_labelled_and_untainted_needs_no_patch() -> None:
    assert plan_node_update(node(labels={READY_LABEL: "ready"}, taints=[GPU_TAINT]), Outcome.READY) is None


def test_removing_the_only_taint_removes_the_list() -> None:
    patch = plan_node_update(node(labels={READY_LABEL: "ready"}, taints=[PENDING]), Outcome.READY)
    assert "taints" not in merge_patch(node(taints=[PENDING]), patch)["spec"]


def test_a_failure_keeps_the_startup_taint_and_takes_back_a_stale_label() -> None:
    patch = plan_node_update(node(labels={READY_LABEL: "ready"}, taints=[PENDING]), Outcome.FAILED)
    assert patch == {"metadata": {"resourceVersion": "41", "labels": {READY_LABEL: None}}}
    assert plan_node_update(node(taints=[PENDING]), Outcome.FAILED) is None


def test_a_node_without_a_cache_loses_the_startup_taint_and_gets_no_label() -> None:
    patch = plan_node_update(node(taints=[PENDING, GPU_TAINT]), Outcome.ABSENT)
    assert patch == {"metadata": {"resourceVersion": "41"}, "spec": {"taints": [GPU_TAINT]}}


# Parsers ----------------------------------------------------------------------------------------------------------


def test_blkid_export_output_is_read_with_its_escapes() -> None:
    text = "DEVNAME=/dev/loop0\nLABEL=my\\ cache\nTYPE=xfs\n"
    assert parse_blkid(text) == {"DEVNAME": "/dev/loop0", "LABEL": "my cache", "TYPE": "xfs"}


MOUNTINFO = (
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "90 22 7:0 / /mnt/model\\040cache rw,noatime shared:40 - ext4 /dev/loop0 rw\n"
    "91 90 7:1 / /mnt/model\\040cache rw,noatime shared:41 - xfs /dev/loop1 rw,inode64\n"
)


def test_the_topmost_mount_at_the_cache_path_is_found_with_octal_escapes() -> None:
    found = Mounted(source="/dev/loop1", fstype="xfs", root="/", shared=True)
    assert parse_mountinfo(MOUNTINFO, "/mnt/model cache") == found
    assert parse_mountinfo(MOUNTINFO, "/mnt/other") is None


# /proc/self/mountinfo in the node agent's init container (proc(5): ID, parent ID, major:minor, root, mount point,
# options, optional fields up to "-", type, source). The kubelet bind-mounts the hostPath: its root is the host
# directory on the host's root device; Bidirectional makes it a shared mount (the host's peer group, shared:1).
ROOTFS = "1420 1100 0:410 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/containerd/l1,upperdir=/u,workdir=/w\n"
HOSTPATH = "1437 1420 259:1 /mnt/model-cache /mnt/model-cache rw,relatime shared:1 - ext4 /dev/vda rw\n"
OURS = "1502 1437 7:0 / /mnt/model-cache rw,noatime shared:310 - xfs /dev/loop0 rw,inode64,noquota\n"


def test_the_kubelets_bind_of_the_host_path_is_read_as_a_shared_bound_directory() -> None:
    assert parse_mountinfo(ROOTFS + HOSTPATH, "/mnt/model-cache") == Mounted(
        source="/dev/vda", fstype="ext4", root="/mnt/model-cache", shared=True
    )


def test_the_cache_is_formatted_and_mounted_over_the_kubelets_bind_of_the_host_path() -> None:
    probed = state(disk("/dev/loop0"), mounted=parse_mountinfo(ROOTFS + HOSTPATH, "/mnt/model-cache"))
    plan = plan_cache(["/dev/loop0"], probed, SETTINGS)
    assert [s.argv for s in plan.steps] == [
        ("mkfs.xfs", "-K", "-L", "model-cache", "/dev/loop0"),
        ("mkdir", "-p", "/mnt/model-cache"),
        ("mount", "-o", "noatime", "/dev/loop0", "/mnt/model-cache"),
    ]
    assert plan.target == "/dev/loop0"


def test_the_cache_mounted_over_the_bind_is_found_on_top_and_plans_nothing() -> None:
    mounted = parse_mountinfo(ROOTFS + HOSTPATH + OURS, "/mnt/model-cache")
    assert mounted == Mounted(source="/dev/loop0", fstype="xfs", root="/", shared=True)
    probed = state(disk("/dev/loop0", "xfs", "model-cache"), mounted=mounted)
    assert plan_cache(["/dev/loop0"], probed, SETTINGS).steps == ()


def test_the_topmost_mount_is_the_one_no_other_sits_on_wherever_it_is_listed() -> None:
    # A mount moved beneath another (move_mount(2) MOVE_MOUNT_BENEATH) is listed after the one above it.
    beneath = "1503 1437 7:1 / /mnt/model-cache rw - ext4 /dev/loop1 rw\n"
    above = OURS.replace(" 1437 ", " 1503 ")
    assert parse_mountinfo(HOSTPATH + above + beneath, "/mnt/model-cache") == Mounted(
        source="/dev/loop0", fstype="xfs", root="/", shared=True
    )


@given(st.permutations(range(4)))
def test_the_topmost_of_a_stack_is_found_in_any_listing_order(order: list[int]) -> None:
    stack = [f"{100 + i} {99 + i} 7:{i} / /mnt/model-cache rw - xfs /dev/loop{i} rw" for i in range(4)]
    found = parse_mountinfo("\n".join(stack[i] for i in order), "/mnt/model-cache")
    assert found == Mounted(source="/dev/loop3", fstype="xfs")


def test_a_restarted_init_container_finds_the_cache_the_host_has_through_its_bind_and_plans_nothing() -> None:
    # After a pod restart the kubelet binds the host directory again; the cache mounted on it there comes whole.
    rebound = "1610 1420 7:0 / /mnt/model-cache rw,noatime shared:310 - xfs /dev/loop0 rw,inode64,noquota\n"
    mounted = parse_mountinfo(ROOTFS + rebound, "/mnt/model-cache")
    probed = state(disk("/dev/loop0", "xfs", "model-cache"), mounted=mounted)
    assert plan_cache(["/dev/loop0"], probed, SETTINGS).steps == ()


def test_a_foreign_filesystem_at_the_host_path_is_still_refused() -> None:
    foreign = "1610 1420 259:3 / /mnt/model-cache rw,relatime shared:77 - ext4 /dev/nvme3n1 rw\n"
    probed = state(disk("/dev/loop0"), mounted=parse_mountinfo(ROOTFS + foreign, "/mnt/model-cache"))
    with pytest.raises(CacheError, match=r"already mounted from /dev/nvme3n1 \(ext4\), not from /dev/loop0"):
        plan_cache(["/dev/loop0"], probed, SETTINGS)


@pytest.mark.parametrize("propagation", ["master:1", "", "unbindable"], ids=["HostToContainer", "None", "unbindable"])
def test_a_bound_host_path_that_would_not_carry_the_mount_to_the_host_is_refused_before_any_write(
    propagation: str,
) -> None:
    bound = HOSTPATH.replace(" shared:1 ", f" {propagation} ".replace("  ", " "))
    probed = state(disk("/dev/loop0"), mounted=parse_mountinfo(ROOTFS + bound, "/mnt/model-cache"))
    with pytest.raises(CacheError, match="mountPropagation: Bidirectional") as caught:
        plan_cache(["/dev/loop0"], probed, SETTINGS)
    assert (caught.value.step, caught.value.device) == ("mount", "/mnt/model-cache")


def test_recorded_uuids_compare_with_the_ones_blkid_prints() -> None:
    assert recorded_uuids(RECORD) == {ARRAY_UUID_BLKID.replace("-", "")}


@given(st.text() | st.lists(st.sampled_from(["-", " ", "/a", "x", "\\040", "\n", "1"])).map("".join))
def test_no_text_crashes_the_parsers(text: str) -> None:
    parse_blkid(text)
    parse_mountinfo(text, "/a")
    recorded_uuids(text)


# Settings ---------------------------------------------------------------------------------------------------------


def test_cache_flags_read_their_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTDRAIN_MODEL_CACHE_FS", "ext4")
    monkeypatch.setenv("SPOTDRAIN_MODEL_CACHE_FORCE", "true")
    monkeypatch.setenv("NODE_NAME", "gpu-1")
    settings = command_from_arguments(build_parser().parse_args(["cache", "--model-cache-devices", "/dev/loop*"]))
    assert (settings.cache.fs, settings.cache.force, settings.node_name) == ("ext4", True, "gpu-1")
    assert (settings.cache.devices, settings.cache.path) == ("/dev/loop*", Path("/mnt/model-cache"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model-cache-path", "cache"], "--model-cache-path must be an absolute path"),
        (["--model-cache-name", "model cache"], "--model-cache-name must be"),
        (["--model-cache-state-dir", "state"], "--model-cache-state-dir must be an absolute path"),
    ],
)
def test_invalid_cache_flags_are_refused_with_the_reason(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        command_from_arguments(build_parser().parse_args(["cache", *argv]))


def with_models(annotation: str, **fields: Any) -> dict[str, Any]:
    before = node(**fields)
    before["metadata"]["annotations"] = {MODELS_ANNOTATION: annotation}
    return before


def test_waiting_for_models_keeps_the_startup_taint_only_where_the_node_names_a_model_and_has_a_cache() -> None:
    named = with_models("qwen=s3://models/qwen/", taints=[GPU_TAINT, PENDING])
    assert plan_node_update(named, Outcome.READY, wait_for_models=True) == {
        "metadata": {"resourceVersion": "41", "labels": {READY_LABEL: "ready"}}
    }
    assert plan_node_update(named, Outcome.READY)["spec"] == {"taints": [GPU_TAINT]}  # type: ignore[index]
    # Nothing valid to fetch, or no cache to fetch into: nothing to wait for.
    for unnamed in (with_models("qwen", taints=[PENDING]), node(taints=[PENDING])):
        assert plan_node_update(unnamed, Outcome.READY, wait_for_models=True)["spec"] == {"taints": None}  # type: ignore[index]
    assert plan_node_update(named, Outcome.ABSENT, wait_for_models=True)["spec"] == {"taints": [GPU_TAINT]}  # type: ignore[index]
