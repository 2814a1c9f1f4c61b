"""A machine without xfsprogs: the model-cache tests that need mkfs.xfs skip, naming it, and none fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import pytest

ROOT = Path(__file__).resolve().parents[2]


def path_without(tool: str, scratch: Path) -> str:
    """A PATH holding every program of this one (first found wins, as a shell would) but ``tool``."""
    scratch.mkdir()
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not directory or not Path(directory).is_dir():
            continue
        for program in Path(directory).iterdir():
            link = scratch / program.name
            if program.name != tool and not link.exists() and os.access(program, os.X_OK):
                link.symlink_to(program)
    return str(scratch)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("losetup") is None, reason="without root and losetup every cache test skips"
)
def test_without_mkfs_xfs_the_cache_tests_that_need_it_skip_naming_it(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": path_without("mkfs.xfs", tmp_path / "bin")}
    report = tmp_path / "report.xml"
    argv = [sys.executable, "-m", "pytest", "tests/integration/test_cache_devices.py", "-q", "-p", "no:cacheprovider"]
    argv.append(f"--junitxml={report}")
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    outcomes = {case.get("name"): outcome(case) for case in ElementTree.parse(report).iter("testcase")}
    for test in XFS_TESTS:
        assert outcomes[test] == "skipped: not on PATH: mkfs.xfs (xfsprogs)", test
    if shutil.which("mkfs.ext4") is not None:  # the same test on ext4 still runs
        assert outcomes["test_a_first_run_formats_mounts_labels_the_node_and_removes_the_taint[ext4]"] == "passed"


def outcome(case: ElementTree.Element) -> str:
    for child in case:
        if child.tag in ("skipped", "failure", "error"):
            return f"{child.tag}: {child.get('message', '')}"
    return "passed"


XFS_TESTS = (
    "test_a_first_run_formats_mounts_labels_the_node_and_removes_the_taint[xfs]",
    "test_a_second_run_on_a_ready_node_changes_nothing",
    "test_after_a_reboot_the_cache_is_mounted_again_without_formatting[xfs]",
)
