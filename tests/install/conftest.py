"""The image tier (``make test-e2e``): the four images built from the Dockerfiles as they are, and run as the
manifests run them. Collected only with SPOTDRAIN_E2E_TIER=1: it builds images, which the default run must not."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.install.engine import Built, Podman, Unavailable, build, open_store, prune

collect_ignore_glob = [] if os.environ.get("SPOTDRAIN_E2E_TIER") == "1" else ["test_*.py"]

BUILT: dict[str, Built] = {}  # for the summary: each image's size and build time


class Images:
    """Each Dockerfile built once per run, when a test first needs its image; a build that failed fails every test
    that needs it, with the build's output."""

    def __init__(self, podman: Podman) -> None:
        self.podman = podman
        self.failed: dict[str, str] = {}

    def __call__(self, program: str) -> Built:
        if program in self.failed:
            pytest.fail(self.failed[program])
        if program not in BUILT:
            try:
                BUILT[program] = build(self.podman, program)
            except AssertionError as error:
                self.failed[program] = str(error)
                raise
        return BUILT[program]

    def user(self, program: str) -> str:
        config = self.podman.inspect(self(program).tag).get("Config") or {}
        return str(config.get("User", "")) if isinstance(config, dict) else ""


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    try:
        podman = open_store()
    except Unavailable as reason:
        pytest.skip(f"the image tier cannot run because {reason}")
    try:
        yield podman
    finally:
        podman.remove_containers()
        prune(podman)


@pytest.fixture(scope="session")
def images(podman: Podman) -> Images:
    return Images(podman)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not BUILT:
        return
    terminalreporter.section("images")
    for built in BUILT.values():
        megabytes = built.size_bytes / 1e6
        terminalreporter.write_line(f"{built.tag}: {megabytes:.0f} MB, built in {built.seconds:.1f} s")
