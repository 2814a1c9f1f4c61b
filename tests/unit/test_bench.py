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


def run_bench_code(code: str) -> Any:
    """Run ``code`` (which prints one JSON value) in a process of its own; returns that value."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_pss_is_read_from_smaps_rollup_and_is_none_where_the_kernel_has_none(tmp_path: Path) -> None:
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "smaps_rollup").write_text(
        "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss: 9216 kB\nPss: 3072 kB\n"
    )
    (tmp_path / "42").mkdir()  # a process whose kernel has no smaps_rollup (before Linux 4.14)
    code = f"""
import json, os
from pathlib import Path
from bench.common import pss_mb, rss_mb
proc = Path({str(tmp_path)!r})
print(json.dumps([pss_mb(41, proc=proc), pss_mb(42, proc=proc), pss_mb(os.getpid()), rss_mb(os.getpid())]))
"""
    fake, missing, own_pss, own_rss = run_bench_code(code)
    assert (fake, missing) == (3.0, None)
    if Path(f"/proc/{os.getpid()}/smaps_rollup").exists():
        assert 0 < own_pss <= own_rss


PROBES = """
import asyncio, json, ssl
from aiohttp import web
from bench.footprint import Probe, probing
from simulate.fakes.processes import free_port

async def main():
    app = web.Application()
    app.router.add_get("/ok", lambda request: web.Response(text="ok"))
    app.router.add_get("/draining", lambda request: web.Response(status=503))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    closed = free_port()
    failures = []
    urls = [f"http://127.0.0.1:{port}/ok", f"http://127.0.0.1:{port}/draining", f"http://127.0.0.1:{closed}/ready"]
    context = ssl.create_default_context()
    tasks = [asyncio.create_task(probing(Probe(url, 0.1), context, failures)) for url in urls]
    await asyncio.sleep(0.35)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await runner.cleanup()
    print(json.dumps({"failures": failures, "draining": urls[1], "closed": urls[2]}))

asyncio.run(main())
"""


def test_the_footprint_probes_note_every_answer_that_is_not_a_200_and_every_refused_connection() -> None:
    seen = run_bench_code(PROBES)
    failed = {failure.partition(": ")[0] for failure in seen["failures"]}
    assert failed == {seen["draining"], seen["closed"]}
    assert f"{seen['draining']}: 503" in seen["failures"]
    assert len(seen["failures"]) >= 4  # each probe repeats every period, failing each time


CPU_MARKS = """
import json, os, subprocess, sys, time
from bench.common import CpuMark, SCHEDSTAT
spin = "import threading, time\\ndef spin(s):\\n  end = time.process_time() + s\\n"
spin += "  while time.process_time() < end: pass\\n"
then = "print('started', flush=True); input(); spin(0.2)\\nt = threading.Thread(target=spin, args=(0.3,))\\n"
then += "t.start(); t.join(); print('ended', flush=True); input()"
child = subprocess.Popen([sys.executable, "-c", spin + then], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
child.stdout.readline()
first = CpuMark.of(child.pid)
child.stdin.write("\\n"); child.stdin.flush()
child.stdout.readline()  # both spins done, the thread ended
second = CpuMark.of(child.pid)
time.sleep(0.2)
third = CpuMark.of(child.pid)  # idle: nothing since the second
child.kill()
own = CpuMark.of(os.getpid())
end = time.process_time() + 0.0155
while time.process_time() < end:
    pass
print(json.dumps([SCHEDSTAT, second.since(first), third.since(second), CpuMark.of(os.getpid()).since(own)[0]]))
"""


def test_a_cpu_mark_counts_to_the_nanosecond_and_a_thread_that_ended_between_marks_by_the_ticks() -> None:
    schedstat, (spun, spun_system), (idle, idle_system), short = run_bench_code(CPU_MARKS)
    assert 0.48 <= spun <= 0.6, "the main thread's 0.2 s and the ended thread's 0.3 s (from the ticks)"
    assert 0 <= spun_system <= spun
    assert 0 <= idle < 0.01
    assert idle_system == 0
    if schedstat:
        assert 0.0155 <= short < 0.019, "15.5 ms counted as such, where ticks of 10 ms say 10 or 20"
