"""The image tier (``make test-e2e``): the four images built from the Dockerfiles as they are, and run as the
manifests run them. Collected only with SPOTDRAIN_E2E_TIER=1: it builds images, which the default run must not."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from moto.moto_server.threaded_moto_server import ThreadedMotoServer

from tests.install import installing, scraping, sweep
from tests.install import node as real_node
from tests.install.engine import ROOT, Built, Podman, Unavailable, build, open_store, prune

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


GPU_TAINT = "nvidia.com/gpu=true:NoSchedule"  # as a GPU NodePool taints its nodes
STARTUP_TAINT = "spotdrain.io/model-cache-pending=:NoSchedule"
STABLE = real_node.stable_node()


def _spot() -> real_node.NodeSpec:
    """The Spot node as deploy/components/karpenter's NodePool launches it: its template's labels (the cache's
    ``spotdrain.io/model-cache: ready`` among them), the GPU taint and the startup taint the agent removes."""
    pool = yaml.safe_load((ROOT / "deploy/components/karpenter/nodepool.yaml").read_text())
    spot = real_node.spot_node(taints=[GPU_TAINT, STARTUP_TAINT])
    return replace(spot, labels={**spot.labels, **pool["spec"]["template"]["metadata"]["labels"]})


SPOT = _spot()
NODE_ROLE = "KarpenterNodeRole-spotdrain-e2e"  # the EC2NodeClass's role, whose credentials the node's IMDS serves
CLUSTER_TIMINGS: dict[str, float] = {}
_SHARED: list[real_node.Cluster] = []  # the one Cluster a process may run, while it runs


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[real_node.Cluster]:
    """The real nodes, once for the whole run (a process may run one Cluster): the Spot node with its fake IMDS,
    and the stable node. Stopped at the end of the run, or before test_node_stop.py, which starts its own."""
    started = time.monotonic()
    harness = real_node.Cluster([SPOT, STABLE])
    try:
        harness.__enter__()
    except real_node.Unavailable as reason:
        pytest.skip(f"no real node can run here because {reason}")
    _SHARED.append(harness)
    try:
        CLUSTER_TIMINGS.update({f"cluster: {name}": seconds for name, seconds in harness.timings.items()})
        harness.node(SPOT.name).start_imds("--role", NODE_ROLE)
        CLUSTER_TIMINGS["cluster up"] = time.monotonic() - started
        yield harness
    finally:
        _stop_shared()


@pytest.fixture(scope="session")
def installed(
    shared_cluster: real_node.Cluster, images: Images, podman: Podman, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[installing.Installed]:
    """The install of README.md, once for the run: test_install.py checks it, then test_notice.py interrupts its
    node; the cluster's stop takes it away. Prometheus scrapes it from the moment it is applied (``prometheus``)."""
    cluster, directory = shared_cluster, tmp_path_factory.mktemp("install")
    made_state = not installing.STATE.exists()
    s3 = ThreadedMotoServer(ip_address="10.213.0.1", port=0, verbose=False)  # the host side of the nodes' veths
    timeline = installing.Timeline()
    tags = [images(program).tag for program in ("agent", "sidecar", "webhook")]
    try:
        done = installing.install(cluster, tags, podman, s3, directory, timeline)
        try:
            _SCRAPING.append(scraping.start(cluster.kubeconfig, tmp_path_factory.mktemp("prometheus")))
            timeline.note("Prometheus started on the shipped PodMonitors")
        except Exception as error:  # the tests that need it skip or fail with it; the install's others go on
            _SCRAPING.append(error)
        yield done
    finally:
        while _SCRAPING:
            scraper = _SCRAPING.pop()
            if isinstance(scraper, scraping.Prometheus):
                scraper.stop()
        s3.stop()
        print("\n" + "\n".join(timeline.lines()))
        if made_state and installing.STATE.is_dir() and not any(installing.STATE.iterdir()):
            installing.STATE.rmdir()


_SCRAPING: list[scraping.Prometheus | Exception] = []  # the install's Prometheus, or why none runs


@pytest.fixture(scope="session")
def prometheus(installed: installing.Installed) -> scraping.Prometheus:
    """The Prometheus that has scraped the install since it was applied (tests/install/scraping.py)."""
    scraper = _SCRAPING[-1] if _SCRAPING else RuntimeError("the install did not start it")
    if isinstance(scraper, scraping.Unavailable):
        pytest.skip(f"no Prometheus scrapes the install because {scraper}")
    if isinstance(scraper, Exception):
        pytest.fail(f"Prometheus did not start on the shipped PodMonitors: {scraper!r}")
    scraper.wait_ready()
    return scraper


def _stop_shared() -> None:
    """Stop the shared cluster if it runs, and check it left nothing on the machine."""
    if not _SHARED:
        return
    harness = _SHARED.pop()
    step = time.monotonic()
    harness.__exit__(None, None, None)
    CLUSTER_TIMINGS["cluster stopped"] = time.monotonic() - step
    left = sweep.leftovers(real_node.STORE)
    assert not left, f"the stopped cluster left {left}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The install after test_node.py, which checks the nodes as they registered (the startup taint still on), then
    the cases that interrupt the Spot node one after the other (each leaves it cordoned and its engine pod evicted,
    and the next begins with ``reset.fresh_spot_node``), then the metrics Prometheus scraped through them all, and
    test_node_stop.py last, once the shared cluster has stopped."""
    rank = {
        "test_install.py": 1,
        "test_notice.py": 2,
        "test_gateway.py": 3,
        "test_agent_restart.py": 4,
        "test_metrics.py": 5,
        "test_node_stop.py": 9,
    }
    # pytest gives this hook every item of the run: modules of the same name elsewhere (tests/integration's
    # test_gateway.py) keep their place
    here = Path(__file__).parent
    items.sort(key=lambda item: rank.get(item.path.name, 0) if item.path.parent == here else 0)  # stable sort


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.path.name == "test_node_stop.py":
        _stop_shared()  # what it left fails this test's setup


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not BUILT:
        return
    terminalreporter.section("images")
    for built in BUILT.values():
        megabytes = built.size_bytes / 1e6
        terminalreporter.write_line(f"{built.tag}: {megabytes:.0f} MB, built in {built.seconds:.1f} s")
