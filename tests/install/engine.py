"""Podman for the image tier: a store of the tier's own outside the repository (kept between runs as the build
cache), the stand-in base image loaded into it, the four Dockerfiles built unchanged, containers run and removed.

What the machines need is in ``../shared/images/README.md``: runc (crun fails every container on their hybrid
cgroup layout), rlimits no higher than the caller's hard limits, and the host's CA bundle in pip's trust for the
build's RUN steps (a TLS-inspecting egress stands between them and PyPI).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT.parent / "shared" / "images"  # where CI's clone finds the shared folder, as tests/control_plane.py does
BASE_ARCHIVE = "python-3.11-slim-bookworm.tar.xz"
BASE = "docker.io/library/python:3.11-slim-bookworm"
STORE = Path(os.environ.get("SPOTDRAIN_E2E_STORE", "/var/tmp/spotdrain-e2e/podman"))
# Dockerfile.<program> builds ghcr.io/spotdrain/spotdrain-<program>.
PROGRAMS = ("agent", "sidecar", "gateway", "webhook")
REPOSITORY = "ghcr.io/spotdrain/spotdrain-"
LABEL = "io.spotdrain.e2e"  # on every container the tier runs, so one a killed run left is found and removed
BUILD_TIMEOUT_S = 900.0
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


class Unavailable(Exception):
    """A part the tier needs cannot be had here: the tests that need it report skipped with this reason."""


@dataclass
class Built:
    program: str
    tag: str
    seconds: float
    size_bytes: int = 0


@dataclass
class Podman:
    """podman with the tier's store and containers.conf; every call bounded by a timeout."""

    store: Path
    executable: str
    built: dict[str, Built] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.store / "containers.conf"

    def argv(self, *args: str) -> list[str]:
        return [self.executable, "--root", str(self.store / "root"), "--runroot", str(self.store / "runroot"), *args]

    def run(self, *args: str, timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
        try:
            done = subprocess.run(
                self.argv(*args), capture_output=True, text=True, timeout=timeout_s, env=env, check=False
            )
        except subprocess.TimeoutExpired as error:
            raise AssertionError(f"podman {' '.join(args[:3])} … took over {timeout_s} s") from error
        if check and done.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}:\n{tail(done.stderr)}")
        return done

    def inspect(self, reference: str) -> dict[str, object]:
        found: list[dict[str, object]] = json.loads(self.run("image", "inspect", reference).stdout)
        return found[0]

    def remove_containers(self) -> None:
        """Remove the tier's containers, a killed run's included."""
        ids = self.run("ps", "-aq", "--filter", f"label={LABEL}").stdout.split()
        if ids:
            self.run("rm", "-f", "-t", "0", *ids, check=False)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def tag_of(program: str) -> str:
    return f"{REPOSITORY}{program}:e2e"


def program_of(image: str) -> str | None:
    """Which Dockerfile builds a manifest's image (``ghcr.io/spotdrain/spotdrain-agent:0.1.0`` → agent)."""
    if not image.startswith(REPOSITORY):
        return None
    name = image.removeprefix(REPOSITORY).partition("@")[0].partition(":")[0]
    return name if name in PROGRAMS else None


def open_store() -> Podman:
    """The tier's podman, its store made and the stand-in base loaded; Unavailable says why it cannot be."""
    executable = shutil.which("podman")
    if executable is None:
        raise Unavailable("podman is not installed (Debian's podman, buildah and runc)")
    if shutil.which("runc") is None:
        raise Unavailable("runc is not installed: crun cannot run containers on a hybrid cgroup layout")
    archive = IMAGES / BASE_ARCHIVE
    if not archive.is_file():
        raise Unavailable(f"no {archive}: the stand-in for python:3.11-slim-bookworm (no registry is reachable)")
    try:
        STORE.mkdir(parents=True, exist_ok=True)
        podman = Podman(STORE, executable)
        podman.conf.write_text(containers_conf())
        info = podman.run("info", "--format", "{{.Host.OCIRuntime.Name}}", timeout_s=60, check=False)
    except OSError as error:
        raise Unavailable(f"the store {STORE} cannot be made: {error}") from error
    if info.returncode != 0:
        raise Unavailable(f"podman cannot run here (root is needed for its store): {tail(info.stderr, 5)}")
    podman.remove_containers()
    if podman.run("image", "exists", BASE, check=False).returncode != 0:
        podman.run("load", "-i", str(archive), timeout_s=600)
    return podman


def containers_conf() -> str:
    """runc, and rlimits the caller may give (without CAP_SYS_RESOURCE podman's defaults fail every start)."""
    nofile = min(_hard(resource.RLIMIT_NOFILE), 1 << 20)
    nproc = min(_hard(resource.RLIMIT_NPROC), 32768)
    return (
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
    )


def _hard(limit: int) -> int:
    hard = resource.getrlimit(limit)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else hard


def host_ca_bundle() -> Path | None:
    """The CA bundle the host's pip trusts: PIP_CERT, pip's configured ``cert``, SSL_CERT_FILE, Debian's bundle."""
    candidates = [os.environ.get("PIP_CERT"), _pip_config_cert(), os.environ.get("SSL_CERT_FILE"), str(CA_BUNDLE)]
    return next((Path(c) for c in candidates if c and Path(c).is_file()), None)


def _pip_config_cert() -> str | None:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".cert"):
            return value.strip().strip("'\"")
    return None


def trust_mounts(directory: Path) -> list[str]:
    """``-v`` flags that give the build's RUN steps the host's CA bundle in pip's trust (never a layer of the
    image), as ../shared/images/README.md describes; none where the host has no bundle."""
    bundle = host_ca_bundle()
    if bundle is None:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(bundle, directory / "ca.pem")
    (directory / "pip.conf").write_text("[global]\ncert = /run/build-trust/ca.pem\n")
    return ["-v", f"{directory}:/run/build-trust:ro", "-v", f"{directory / 'pip.conf'}:/etc/pip.conf:ro"]


def build_file(
    podman: Podman, dockerfile: Path, tag: str, context: Path = ROOT, *target: str
) -> subprocess.CompletedProcess[str]:
    """``podman build`` of one Dockerfile (to the stage ``--target`` names, if given), with the build cache and the
    host's trust for pip."""
    mounts = trust_mounts(podman.store / "build-trust")
    args = ["build", "--pull=never", "--layers", *mounts, *target, "-f", str(dockerfile), "-t", tag, str(context)]
    return podman.run(*args, timeout_s=BUILD_TIMEOUT_S, check=False)


def build(podman: Podman, program: str) -> Built:
    """``podman build`` of Dockerfile.<program> from the checkout, as it is; an AssertionError with the build's
    output where it fails. Its ``build`` stage is tagged too, so that pruning the untagged images keeps it as the
    next run's cache."""
    started = time.monotonic()
    dockerfile = ROOT / f"Dockerfile.{program}"
    done = None
    if re.search(r"^FROM \S+ AS build$", dockerfile.read_text(), re.MULTILINE | re.IGNORECASE):
        done = build_file(podman, dockerfile, f"{tag_of(program)}-build", ROOT, "--target", "build")
    if done is None or done.returncode == 0:
        done = build_file(podman, dockerfile, tag_of(program))
    if done.returncode != 0:
        raise AssertionError(f"Dockerfile.{program} does not build:\n{tail(done.stdout + done.stderr, 60)}")
    built = Built(program, tag_of(program), time.monotonic() - started)
    size = podman.inspect(built.tag).get("Size", 0)
    built.size_bytes = size if isinstance(size, int) else 0
    return built


def prune(podman: Podman) -> None:
    """Drop the images no tag reaches any more (the build stages and images earlier runs replaced); the tagged ones
    and their layers stay as the next run's cache."""
    podman.run("image", "prune", "-f", timeout_s=300, check=False)


def run_once(podman: Podman, options: Sequence[str], image: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A container run to its end and removed."""
    return podman.run("run", "--rm", "--pull=never", "--label", LABEL, *options, image, *args, check=False)


def start_container(podman: Podman, options: Sequence[str], image: str, *args: str) -> str:
    """A container started in the background (its name); remove it with ``remove``."""
    name = f"spotdrain-e2e-{uuid.uuid4().hex[:12]}"
    podman.run("run", "-d", "--pull=never", "--name", name, "--label", LABEL, *options, image, *args)
    return name


def published_port(podman: Podman, name: str, port: int) -> int:
    mapping = podman.run("port", name, f"{port}/tcp").stdout.strip().splitlines()[0]
    return int(mapping.rpartition(":")[2])


def remove(podman: Podman, name: str) -> str:
    """Remove the container; its output."""
    logs = podman.run("logs", name, check=False)
    podman.run("rm", "-f", "-t", "0", name, check=False)
    return logs.stdout + logs.stderr
