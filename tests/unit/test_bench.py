"""A benchmark that cannot run here says so: skipped, with its reason, and no figure that could pass for one.

Run in a process of their own: importing ``bench`` configures logging for a benchmark's standard output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASURE = """
import asyncio, os, sys
os.geteuid = lambda: {uid}
from bench import cache, prestop
from bench.common import missed, report
results = asyncio.run(cache.measure()) + prestop.measure()
report(results)
sys.exit(1 if missed(results) else 0)
"""


def measured(tmp_path: Path, *, uid: int, tools: dict[str, str]) -> list[dict[str, Any]]:
    """The cache and preStop benchmarks' results with only ``tools`` (name: sh script) on PATH, as uid ``uid``."""
    for name, script in tools.items():
        (tmp_path / name).write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE.format(uid=uid)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    results: list[dict[str, Any]] = json.loads(done.stdout)
    return results


def assert_all_skipped(results: list[dict[str, Any]], because: str) -> None:
    assert results
    for result in results:
        assert (result["value"], result["passed"]) == (None, None), result["name"]
        assert result["detail"] == f"skipped: {result['skipped']}"
    cache = [r for r in results if r["name"].startswith("cache_")]
    assert len(cache) == 4
    assert all(because in r["skipped"] for r in cache), cache


def test_without_root_or_tools_every_figure_is_skipped_with_its_reason(tmp_path: Path) -> None:
    results = measured(tmp_path, uid=1000, tools={})
    assert_all_skipped(results, "needs root")
    assert {r["skipped"] for r in results if r["name"].startswith("prestop_")} == {
        "dash is not installed here",
        "busybox is not installed here",
        "bash is not installed here",
    }


def test_a_loop_device_that_cannot_be_attached_skips_the_cache_figures_with_losetups_words(tmp_path: Path) -> None:
    if not Path("/bin/sh").exists():
        pytest.skip("no /bin/sh for the stand-in tools")
    losetup = "echo 'losetup: cannot find an unused loop device' >&2; exit 1"
    results = measured(tmp_path, uid=0, tools={"losetup": losetup, "mkfs.xfs": "exit 0"})
    assert_all_skipped(results, "losetup: cannot find an unused loop device")
