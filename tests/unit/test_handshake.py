"""The preStop script under every shell an engine image may have, with and without a ``sleep`` command.

The sidecar's end of the handshake is a real ``DrainDir`` (in this process, or in a child process that the tests
kill); the script runs as the kubelet runs it, ``/bin/sh <dir>/prestop``, but under each shell found here.
"""

from __future__ import annotations

import asyncio
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.handshake import DrainDir
from sidecar.lifecycle import Lifecycle
from sidecar.main import prestop_watcher
from sidecar.metrics import SidecarMetrics
from sidecar.state import Phase
from spotdrain.metrics import CollectorRegistry
from tests.conftest import ask_drain

# Each shell as an argv prefix; a shell this machine lacks is skipped with its reason (CI installs dash and busybox).
SHELLS = {"dash": ["dash"], "busybox ash": ["busybox", "ash"], "bash": ["bash"]}
LIMIT_S = 0.6  # the timer sleeps whole seconds: 1 s
WAKE_S = 0.2  # the drain's end reaches the engine within this


@pytest.fixture(params=sorted(SHELLS))
def shell(request: pytest.FixtureRequest) -> list[str]:
    argv = SHELLS[request.param]
    found = shutil.which(argv[0])
    if found is None:
        pytest.skip(f"{request.param} is not installed here (Debian: apt-get install {argv[0]})")
    return [found, *argv[1:]]


@pytest.fixture(params=["no PATH", "sleep on PATH"])
def path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty PATH, as in an image with nothing but sh; or a PATH holding only ``sleep``."""
    return "" if request.param == "no PATH" else only_sleep(tmp_path)


def only_sleep(tmp_path: Path) -> str:
    sleep = shutil.which("sleep")
    assert sleep is not None
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sleep").symlink_to(sleep)
    return str(bin_dir)


def run_prestop(shell: list[str], drain_dir: DrainDir, path: str) -> subprocess.Popen[bytes]:
    hook = subprocess.Popen([*shell, str(drain_dir.prestop)], env={"PATH": path}, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 5
    while not drain_dir.drain_requested() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drain_dir.drain_requested(), "the hook asks for the drain"
    return hook


def cpu_s(pid: int) -> float:
    """CPU seconds a process and its waited-for children have used, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def drain_dir(tmp_path: Path) -> Iterator[DrainDir]:
    directory = DrainDir(tmp_path / "run")
    yield directory
    directory.mark_drained()


@pytest.fixture
def sidecar_process(drain_dir: DrainDir) -> Iterator[subprocess.Popen[bytes]]:
    """A process holding the handshake as the sidecar does, until it is killed."""
    code = (
        "import signal, sys; from pathlib import Path; from sidecar.handshake import DrainDir;"
        f"DrainDir(Path(sys.argv[1])).prepare(limit_s={LIMIT_S}); print('ready', flush=True); signal.pause()"
    )
    process = subprocess.Popen([sys.executable, "-c", code, str(drain_dir.path)], stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert process.stdout.readline() == b"ready\n"
    yield process
    process.kill()
    process.wait()


def test_prepare_writes_an_executable_prestop_and_clears_a_stale_drained(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path / "run")
    drain_dir.path.mkdir()
    drain_dir.drained.touch()
    assert drain_dir.prepare(limit_s=5) is False
    assert drain_dir.prestop.stat().st_mode & 0o111
    assert not drain_dir.drained.exists()
    assert drain_dir.prestop.read_text().startswith("#!/bin/sh\n")
    assert drain_dir.hold.is_fifo()
    assert drain_dir.hold.stat().st_mode & 0o777 == 0o666, "an engine running as another user opens it too"
    assert drain_dir.ask.is_fifo()
    assert drain_dir.ask.stat().st_mode & 0o777 == 0o666, "an engine running as another user opens it read-write"
    assert drain_dir.take_asks() is False, "nothing asked yet"
    drain_dir.mark_drained()


def test_prepare_reports_a_drain_a_waiting_prestop_already_asked_for(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path)
    drain_dir.drain.touch()
    assert drain_dir.prepare(limit_s=5) is True
    drain_dir.mark_drained()


@pytest.mark.parametrize("kind", ["file", "directory", "symlink"])
def test_prepare_replaces_whatever_is_where_its_files_go(tmp_path: Path, kind: str) -> None:
    drain_dir = DrainDir(tmp_path)
    for path in (drain_dir.hold, drain_dir.ask, drain_dir.drained):
        if kind == "file":
            path.write_text("not a fifo")
        elif kind == "directory":
            (path / "inside").mkdir(parents=True)
        else:
            path.symlink_to(tmp_path / "elsewhere")
    drain_dir.prepare(limit_s=5)
    assert drain_dir.hold.is_fifo()
    assert drain_dir.ask.is_fifo()
    assert not drain_dir.drained.exists()
    assert not drain_dir.drained.is_symlink()
    drain_dir.mark_drained()


def test_prestop_wakes_the_sidecar_through_the_ask_fifo_once_drain_exists(
    shell: list[str], path: str, drain_dir: DrainDir
) -> None:
    drain_dir.prepare(limit_s=30)
    hook = run_prestop(shell, drain_dir, path)
    readable, _, _ = select.select([drain_dir.asks], [], [], 5)
    assert readable == [drain_dir.asks], "the sidecar's descriptor wakes: no timer needed to notice the preStop"
    assert drain_dir.take_asks() is True
    assert drain_dir.take_asks() is False, "read once, asked once"
    assert hook.poll() is None, "writing the ask never ends the wait"
    drain_dir.mark_drained()
    assert hook.wait(timeout=5) == 0
    assert hook.stderr is not None
    assert hook.stderr.read() == b""


@pytest.mark.skipif(os.geteuid() != 0, reason="running the hook as another user needs root")
def test_prestop_run_as_another_user_wakes_the_sidecar(shell: list[str]) -> None:
    with tempfile.TemporaryDirectory() as name:  # in /tmp: every user can reach it, unlike pytest's tmp_path
        Path(name).chmod(0o755)
        directory = Path(name) / "run"
        directory.mkdir()
        directory.chmod(0o777)  # an emptyDir, writable by every container's user
        drain_dir = DrainDir(directory)
        drain_dir.prepare(limit_s=30)
        hook = subprocess.Popen([*shell, str(drain_dir.prestop)], env={"PATH": ""}, user=65534, group=65534)
        try:
            readable, _, _ = select.select([drain_dir.asks], [], [], 5)
            assert readable == [drain_dir.asks], "the engine's user could write into ask"
        finally:
            drain_dir.mark_drained()
            hook.wait(timeout=5)
    assert hook.returncode == 0


def test_prestop_with_no_sidecar_holding_the_ask_fifo_neither_blocks_nor_fails(
    shell: list[str], tmp_path: Path
) -> None:
    drain_dir = DrainDir(tmp_path / "run")
    drain_dir.prepare(limit_s=0.2)
    drain_dir.mark_drained()  # lets go of both FIFOs
    drain_dir.drained.unlink()  # and never drained: the sidecar died, no one holds "ask", the open must not block
    done = subprocess.run([*shell, str(drain_dir.prestop)], env={"PATH": ""}, timeout=5, stderr=subprocess.PIPE)
    assert (done.returncode, done.stderr) == (0, b"")
    assert drain_dir.drain_requested()
    assert drain_dir.ask.is_fifo(), "the open for writing created nothing in its place"


def test_prestop_waits_without_cpu_and_returns_within_a_fifth_of_a_second_of_drained(
    shell: list[str], path: str, drain_dir: DrainDir
) -> None:
    drain_dir.prepare(limit_s=30)
    hook = run_prestop(shell, drain_dir, path)
    time.sleep(0.3)
    assert hook.poll() is None, "the hook must wait for drained"
    spent = cpu_s(hook.pid)
    time.sleep(0.4)
    assert cpu_s(hook.pid) - spent <= 0.01, "waiting must block, not spin"
    drain_dir.mark_drained()
    released = time.monotonic()
    assert hook.wait(timeout=5) == 0
    assert time.monotonic() - released < WAKE_S
    assert hook.stderr is not None
    assert hook.stderr.read() == b"", "nothing missing, nothing printed"


def test_prestop_returns_at_once_when_the_sidecar_has_already_drained(
    shell: list[str], path: str, drain_dir: DrainDir
) -> None:
    drain_dir.prepare(limit_s=30)
    drain_dir.mark_drained()
    started = time.monotonic()
    assert subprocess.run([*shell, str(drain_dir.prestop)], env={"PATH": path}, timeout=5).returncode == 0
    assert time.monotonic() - started < 1


def test_prestop_returns_before_its_limit_ends_when_the_sidecar_dies(
    shell: list[str], path: str, drain_dir: DrainDir, sidecar_process: subprocess.Popen[bytes]
) -> None:
    started = time.monotonic()
    hook = run_prestop(shell, drain_dir, path)
    time.sleep(0.2)
    assert hook.poll() is None
    sidecar_process.send_signal(signal.SIGKILL)
    assert hook.wait(timeout=5) == 0
    waited = time.monotonic() - started
    if path:
        # With a timer the streams keep their chance until the limit (whole seconds), in case a new sidecar comes.
        assert 1.0 <= waited < 3.5
    else:
        assert waited < 1.0, "without a timer nothing could end the wait later: it ends now"


def test_prestop_waits_for_a_restarted_sidecar_while_it_has_a_timer(
    shell: list[str], tmp_path: Path, drain_dir: DrainDir, sidecar_process: subprocess.Popen[bytes]
) -> None:
    # Without a sleep command nothing could end that wait: the hook returns when the sidecar dies (above).
    hook = run_prestop(shell, drain_dir, only_sleep(tmp_path))
    sidecar_process.kill()
    sidecar_process.wait()
    restarted = DrainDir(drain_dir.path)
    restarted.prepare(limit_s=30)
    time.sleep(0.1)
    assert hook.poll() is None
    restarted.mark_drained()
    released = time.monotonic()
    assert hook.wait(timeout=5) == 0
    assert time.monotonic() - released < WAKE_S


def test_prestop_ends_a_hung_sidecars_wait_at_its_limit_where_it_has_a_timer(
    shell: list[str], path: str, drain_dir: DrainDir
) -> None:
    drain_dir.prepare(limit_s=LIMIT_S)  # held open here, never answered
    started = time.monotonic()
    hook = run_prestop(shell, drain_dir, path)
    if path:
        assert hook.wait(timeout=5) == 0
        assert 1.0 <= time.monotonic() - started < 3.5
        return
    # Without a timer only the kubelet's grace period ends the wait of a sidecar alive but silent.
    time.sleep(LIMIT_S + 0.4)
    assert hook.poll() is None
    threading.Timer(0.1, drain_dir.mark_drained).start()
    assert hook.wait(timeout=5) == 0


def test_prestop_handles_a_directory_with_a_quote_in_its_name(tmp_path: Path) -> None:
    drain_dir = DrainDir(tmp_path / "it's here")
    drain_dir.prepare(limit_s=0.2)
    drain_dir.mark_drained()
    assert subprocess.run(["/bin/sh", str(drain_dir.prestop)], timeout=5).returncode == 0
    assert drain_dir.drain_requested()


async def test_the_watcher_asks_for_the_drain_when_the_prestop_writes_and_then_stops_watching(tmp_path: Path) -> None:
    drain_dir, lifecycle = DrainDir(tmp_path), Lifecycle(SidecarMetrics.create(CollectorRegistry()))
    drain_dir.prepare(limit_s=5)
    watcher = asyncio.create_task(prestop_watcher(drain_dir, lifecycle))
    await asyncio.sleep(0)
    assert not watcher.done()
    ask_drain(tmp_path)
    await asyncio.wait_for(watcher, 5)
    assert (lifecycle.reason, lifecycle.phase) == ("prestop", Phase.DRAINING)
    assert asyncio.get_running_loop().remove_reader(drain_dir.asks) is False, "the descriptor is no longer watched"
    drain_dir.mark_drained()


async def test_the_watcher_returns_once_a_drain_starts_another_way_and_a_late_prestop_changes_nothing(
    tmp_path: Path,
) -> None:
    drain_dir, lifecycle = DrainDir(tmp_path), Lifecycle(SidecarMetrics.create(CollectorRegistry()))
    drain_dir.prepare(limit_s=5)
    watcher = asyncio.create_task(prestop_watcher(drain_dir, lifecycle))
    await asyncio.sleep(0)
    lifecycle.ask_drain("sigterm")  # the kubelet signals the sidecar while it runs the engine's preStop
    await asyncio.wait_for(watcher, 5)
    ask_drain(tmp_path)
    assert lifecycle.reason == "sigterm"
    assert asyncio.get_running_loop().remove_reader(drain_dir.asks) is False
    drain_dir.mark_drained()
