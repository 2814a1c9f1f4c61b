"""The four Dockerfiles build unchanged against python:3.11-slim-bookworm, and each image carries what its label says
and no more than its extra needs."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from tests.distributions import closure, normalized
from tests.install.conftest import Images
from tests.install.engine import BASE, PROGRAMS, ROOT, Podman, build_file, run_once

COMMANDS_LABEL = "io.spotdrain.commands"
# What each image installs: Dockerfile.<program>'s `pip install '.[extras]'`.
EXTRAS: dict[str, tuple[str, ...]] = {
    "agent": ("node",),
    "sidecar": (),
    "gateway": ("gateway",),
    "webhook": ("webhook", "inject"),
}
CACHE_TOOLS = ("mdadm", "mkfs.xfs", "mkfs.ext4", "blkid", "lsblk", "mount")
CACHE_PACKAGES = ("mdadm", "xfsprogs", "e2fsprogs", "util-linux", "mount")
# A base with Debian's own Python 3.11 in /usr and none in /usr/local: the build stage's prefix, copied to /usr/local,
# lands where no Python looks, and `spotdrain`'s #! names an interpreter that is not there.
OTHER_LAYOUT = "localhost/spotdrain-e2e-debian-python:e2e"
OTHER_LAYOUT_DOCKERFILE = f"""FROM {BASE}
RUN apt-get update && apt-get install -y --no-install-recommends python3-minimal \\
    && rm -rf /var/lib/apt/lists/* /usr/local/bin/python* /usr/local/lib/python3.11 /usr/local/lib/libpython*
"""


def commands(podman: Podman, images: Images, program: str) -> list[str]:
    labels = podman.inspect(images(program).tag).get("Labels") or {}
    assert isinstance(labels, dict)
    return str(labels.get(COMMANDS_LABEL, "")).split()


def distribution(requirement: str) -> str:
    """A requirement's distribution name, normalized as PEP 503 does."""
    return normalized(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_dockerfile_builds_a_non_root_image_that_names_its_commands(
    podman: Podman, images: Images, program: str
) -> None:
    assert images.user(program) == "65532:65532"
    assert commands(podman, images, program), f"Dockerfile.{program} sets no {COMMANDS_LABEL} label"


@pytest.mark.parametrize("program", PROGRAMS)
def test_each_command_the_image_names_answers_help_as_its_user_on_a_read_only_root(
    podman: Podman, images: Images, program: str
) -> None:
    for command in commands(podman, images, program):
        options = ["--read-only", "--read-only-tmpfs=false", "--cap-drop=ALL", "--entrypoint", "spotdrain"]
        done = run_once(podman, options, images(program).tag, command, "--help")
        assert done.returncode == 0, f"spotdrain {command} --help in the {program} image:\n{done.stderr}"
        assert done.stdout.startswith(f"usage: spotdrain {command}"), done.stdout


def test_the_agent_image_has_the_cache_tools_from_bookworm(podman: Podman, images: Images) -> None:
    script = (
        ". /etc/os-release && echo $VERSION_CODENAME"
        + "".join(f" && command -v {tool}" for tool in CACHE_TOOLS)
        + f" && dpkg-query -W -f '${{Package}} ${{Version}}\\n' {' '.join(CACHE_PACKAGES)}"
    )
    done = run_once(podman, ["--entrypoint", "sh"], images("agent").tag, "-c", script)
    assert done.returncode == 0, f"a cache tool is missing from the agent image:\n{done.stdout}{done.stderr}"
    codename, *lines = done.stdout.splitlines()
    assert codename == "bookworm"
    assert [Path(line).name for line in lines[: len(CACHE_TOOLS)]] == list(CACHE_TOOLS)
    versions = dict(line.split(" ", 1) for line in lines[len(CACHE_TOOLS) :])
    assert sorted(versions) == sorted(CACHE_PACKAGES)
    # bookworm's xfsprogs is 6.1 (trixie's 6.13): the version the cache's tests on loop devices run with on Debian 12.
    assert versions["xfsprogs"].startswith("6.1."), versions


@pytest.mark.parametrize("program", PROGRAMS)
def test_the_image_installs_its_extra_and_no_other(podman: Podman, images: Images, program: str) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: dict[str, list[str]] = project["optional-dependencies"]
    mine = [r for name in EXTRAS[program] for r in extras[name]]
    own = {distribution(r) for r in [*project["dependencies"], *mine]}
    others = {distribution(r) for name, reqs in extras.items() if name not in EXTRAS[program] for r in reqs}
    # What the image's own requirements need in turn is its own too (kubernetes-asyncio needs PyYAML, the inject
    # extra's); the test extra names the project itself.
    others -= closure(own) | {"spotdrain"}
    installed = _distributions(podman, images(program).tag)
    assert own - {"spotdrain"} <= installed
    added = installed - _distributions(podman, BASE)  # the base's own (pip, setuptools, wheel) are no extra's
    assert not added & others, f"the {program} image installs other extras' {sorted(added & others)}"


def _distributions(podman: Podman, image: str) -> set[str]:
    listing = "import importlib.metadata as m, json; print(json.dumps([d.metadata['Name'] for d in m.distributions()]))"
    done = run_once(podman, ["--entrypoint", "python3"], image, "-c", listing)
    assert done.returncode == 0, done.stderr
    return {distribution(name) for name in json.loads(done.stdout)}


@pytest.fixture(scope="module")
def other_layout(podman: Podman, tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("other-layout")
    (directory / "Dockerfile").write_text(OTHER_LAYOUT_DOCKERFILE)
    done = build_file(podman, directory / "Dockerfile", OTHER_LAYOUT, directory)
    assert done.returncode == 0, done.stderr
    return OTHER_LAYOUT


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_final_stage_on_a_base_without_the_official_layout_fails_the_build(
    podman: Podman, images: Images, other_layout: str, tmp_path: Path, program: str
) -> None:
    images(program)  # its build stage, cached
    lines = (ROOT / f"Dockerfile.{program}").read_text().splitlines()
    final = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    lines[final] = f"FROM {other_layout}"
    (tmp_path / "Dockerfile").write_text("\n".join(lines) + "\n")
    done = build_file(podman, tmp_path / "Dockerfile", f"localhost/spotdrain-e2e-other-layout-{program}:e2e")
    assert done.returncode != 0, f"Dockerfile.{program} builds an image on a base whose Python is not in /usr/local"
    assert 'building at STEP "RUN spotdrain' in done.stderr, done.stderr


def test_the_build_context_holds_the_sources_only(podman: Podman, tmp_path: Path) -> None:
    """What .dockerignore lets into the context, as podman reads it: a Dockerfile that copies the whole context."""
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(f"FROM {BASE}\nCOPY . /context\n")
    tag = "localhost/spotdrain-e2e-context:e2e"
    podman.run("build", "--pull=never", "-f", str(dockerfile), "-t", tag, str(ROOT), timeout_s=300)
    try:
        done = run_once(podman, ["--entrypoint", "ls"], tag, "-A", "/context")
    finally:
        podman.run("rmi", "-f", tag, check=False)
    assert done.returncode == 0, done.stderr
    copied = set(done.stdout.split())
    assert {"pyproject.toml", "README.md", "spotdrain", "agent", "sidecar", "gateway", "webhook"} <= copied
    assert not copied & {".venv", ".git", "tests", "docs", "deploy", "build", "spotdrain.egg-info"}, copied
