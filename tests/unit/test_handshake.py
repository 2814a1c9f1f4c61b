from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from sidecar.handshake import DrainDir


def test_prepare_writes_an_executable_prestop_and_clears_a_stale_drained(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path / "run")
    drain_dir.path.mkdir()
    drain_dir.drained.touch()
    assert drain_dir.prepare(limit_s=5) is False
    assert drain_dir.prestop.stat().st_mode & 0o111
    assert not drain_dir.drained.exists()
    assert drain_dir.prestop.read_text().startswith("#!/bin/sh\n")


def test_prepare_reports_a_drain_a_waiting_prestop_already_asked_for(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path)
    drain_dir.drain.touch()
    assert drain_dir.prepare(limit_s=5) is True


def test_prestop_asks_for_a_drain_and_returns_once_drained(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path)
    drain_dir.prepare(limit_s=30)
    started = time.monotonic()
    hook = subprocess.Popen(["/bin/sh", str(drain_dir.prestop)])
    deadline = time.monotonic() + 5
    while not drain_dir.drain_requested() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drain_dir.drain_requested()
    assert hook.poll() is None, "the hook must wait for drained"
    threading.Timer(0.5, drain_dir.mark_drained).start()
    assert hook.wait(timeout=5) == 0
    assert 0.5 <= time.monotonic() - started < 2.5


def test_prestop_gives_up_after_its_limit_when_the_sidecar_never_answers(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path)
    drain_dir.prepare(limit_s=0.6)
    started = time.monotonic()
    assert subprocess.run(["/bin/sh", str(drain_dir.prestop)], timeout=10).returncode == 0
    assert 0.5 <= time.monotonic() - started < 5


def test_prestop_handles_a_directory_with_a_quote_in_its_name(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path / "it's here")
    drain_dir.prepare(limit_s=0.2)
    drain_dir.mark_drained()
    assert subprocess.run(["/bin/sh", str(drain_dir.prestop)], timeout=5).returncode == 0
    assert drain_dir.drain_requested()
