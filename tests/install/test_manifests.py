"""Each image run as the rendered manifests run it: every container's command answers ``--help`` under the
manifest's user, root filesystem and environment, and the sidecar, gateway and webhook serve their probes with the
manifests' own arguments."""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import pytest

from simulate.fakes.tls import write_tls_files
from tests.deploy.manifests import http_port
from tests.install.conftest import Images
from tests.install.engine import PROGRAMS, Podman, published_port, remove, run_once, start_container
from tests.install.pods import Container, probe_ports, run_options, spotdrain_containers
from tests.install.test_images import commands

STARTED_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def containers() -> list[Container]:
    found = list(spotdrain_containers())
    assert found, "no rendering runs a spotdrain image"
    return found


def subcommand(container: Container) -> str:
    return container.call.subcommand


@pytest.mark.parametrize("program", PROGRAMS)
def test_every_container_of_the_manifests_starts_in_its_image(
    podman: Podman, images: Images, containers: list[Container], program: str
) -> None:
    mine = [c for c in containers if c.program == program]
    assert mine, f"no manifest runs the {program} image"
    offered = commands(podman, images, program)
    tried: set[tuple[str, ...]] = set()
    for container in mine:
        assert subcommand(container) in offered, f"{container.where} runs `spotdrain {subcommand(container)}`"
        options = run_options(container, images.user(program))
        if tuple(options) in tried:
            continue
        tried.add(tuple(options))
        done = run_once(podman, options, images(program).tag, "--help")
        assert done.returncode == 0, f"{container.where}: {' '.join(container.command)} --help\n{done.stderr}"
        assert done.stdout.startswith(f"usage: {' '.join(container.command)}"), done.stdout


def the(containers: list[Container], rendering: str, name: str) -> Container:
    return next(c for c in containers if c.rendering == rendering and c.spec["name"] == name)


# What each program answers without a cluster: the sidecar has no engine beside it, the gateway no API server to
# list its backends from; the webhook needs neither.
SERVING = [
    pytest.param("deploy/vllm", "spotdrain", 503, id="sidecar"),
    pytest.param("deploy/gateway", "gateway", 503, id="gateway"),
    pytest.param("deploy/webhook/cert-manager", "webhook", 200, id="webhook"),
]


@pytest.mark.parametrize(("rendering", "name", "ready_status"), SERVING)
def test_the_program_serves_its_probes_as_its_manifest_runs_it(
    podman: Podman,
    images: Images,
    containers: list[Container],
    tmp_path: Path,
    rendering: str,
    name: str,
    ready_status: int,
) -> None:
    container = the(containers, rendering, name)
    tls = write_tls_files(tmp_path / "tls")
    # cert-manager's Secret as the kubelet mounts it: tls.crt and tls.key, readable by the pod's fsGroup.
    os.link(tls.cert_path, tmp_path / "tls" / "tls.crt")
    os.link(tls.key_path, tmp_path / "tls" / "tls.key")
    tls.key_path.chmod(0o644)
    options = run_options(container, images.user(container.program), volumes={"tls": tmp_path / "tls"})
    options += [f"--publish=127.0.0.1::{port}" for port in probe_ports(container)]
    started = start_container(podman, options, images(container.program).tag, *container.args)
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=tls.ca_path), timeout=2.0) as client:
            live = probe(podman, started, container, "livenessProbe", client)
            ready = probe(podman, started, container, "readinessProbe", client)
    finally:
        logs = remove(podman, started)
    assert live.status_code == 200, f"{container.where}: {live.status_code} {live.text}\n{logs}"
    assert ready.status_code == ready_status, f"{container.where}: {ready.status_code} {ready.text}\n{logs}"


def probe(podman: Podman, started: str, container: Container, kind: str, client: httpx.Client) -> httpx.Response:
    """The probe's answer, through its published port, once the program answers at all."""
    action: Mapping[str, object] = container.spec[kind]["httpGet"]
    port = http_port(container.template, container.spec, action["port"])  # type: ignore[arg-type]
    scheme = str(action.get("scheme", "HTTP")).lower()
    url = f"{scheme}://127.0.0.1:{published_port(podman, started, port)}{action['path']}"
    for _ in attempts(STARTED_WITHIN_S):
        try:
            return client.get(url)
        except httpx.TransportError:
            if podman.run("inspect", "-f", "{{.State.Running}}", started).stdout.strip() != "true":
                break
    raise AssertionError(f"{container.where} never answered {url}:\n{remove(podman, started)}")


def attempts(within_s: float) -> Iterator[None]:
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        yield
        time.sleep(0.2)
