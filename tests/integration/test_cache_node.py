"""Telling the cluster about the model cache: the node's label and startup taint, against the fake API server."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.cache.disks import update_node
from agent.cache.plan import NOTHING_TO_DO, PENDING_TAINT, READY_LABEL, CacheError, Outcome
from agent.cache.run import prepare_cache
from agent.cache.settings import CacheSettings
from agent.drain.nodes import KubeActions, api_client
from simulate.fakes.kube import FakeKube
from spotdrain.ratelimit import RateLimiter

NODE = "gpu-1"
NODE_PATH = r"/api/v1/nodes/gpu-1$"
PENDING = {"key": PENDING_TAINT, "effect": "NoSchedule"}
GPU = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.add_node(NODE, taints=[GPU, PENDING], labels={"team": "llm"})
        yield kube


@pytest.fixture
def kubeconfig(kube: FakeKube, tmp_path: Path) -> Path:
    return kube.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
async def actions(kubeconfig: Path) -> AsyncIterator[KubeActions]:
    async with api_client(str(kubeconfig)) as api:
        yield KubeActions(api, limiter=RateLimiter(qps=100, burst=100), on_error=lambda _: None)


def settings_for(tmp_path: Path, devices: str | None) -> CacheSettings:
    return CacheSettings(
        enabled=True,
        devices=devices,
        fs="xfs",
        path=tmp_path / "cache",
        force=False,
        state_dir=tmp_path / "state",
        name="model-cache",
        root=tmp_path,  # an empty tree: discovery finds no instance-store disk
    )


def labels_and_taints(kube: FakeKube) -> tuple[dict[str, str], list[dict[str, str]]]:
    node = kube.node(NODE)
    return node["metadata"].get("labels", {}), node["spec"].get("taints") or []


def patches(kube: FakeKube) -> int:
    return kube.count("PATCH", "/api/v1/nodes/{name}")


async def test_a_ready_cache_labels_the_node_and_removes_only_the_startup_taint(
    kube: FakeKube, actions: KubeActions
) -> None:
    assert await update_node(actions, NODE, Outcome.READY) is True
    labels, taints = labels_and_taints(kube)
    assert (labels["team"], labels[READY_LABEL]) == ("llm", "ready")
    assert taints == [GPU]


async def test_a_second_update_of_a_ready_node_patches_nothing(kube: FakeKube, actions: KubeActions) -> None:
    await update_node(actions, NODE, Outcome.READY)
    assert await update_node(actions, NODE, Outcome.READY) is False
    assert patches(kube) == 1


async def test_a_conflict_is_resolved_by_reading_the_node_again(kube: FakeKube, actions: KubeActions) -> None:
    kube.fail_next("PATCH", NODE_PATH, 409)
    assert await update_node(actions, NODE, Outcome.READY) is True
    assert (kube.count("GET", "/api/v1/nodes/{name}"), patches(kube)) == (2, 2)
    assert labels_and_taints(kube)[1] == [GPU]


async def test_a_refused_update_is_a_cache_error_naming_the_node(kube: FakeKube, actions: KubeActions) -> None:
    kube.fail_next("PATCH", NODE_PATH, 403)
    with pytest.raises(CacheError, match="HTTP 403") as caught:
        await update_node(actions, NODE, Outcome.READY)
    assert (caught.value.step, caught.value.device) == ("node update", NODE)


async def test_a_failed_preparation_leaves_the_taint_and_takes_back_a_stale_label(
    kube: FakeKube, actions: KubeActions, tmp_path: Path
) -> None:
    await actions.patch_node(NODE, {"metadata": {"labels": {READY_LABEL: "ready"}}})
    missing = str(tmp_path / "nvme1n1")
    with pytest.raises(CacheError, match=missing):
        await prepare_cache(settings_for(tmp_path, missing), actions, node_name=NODE, metrics=None)
    labels, taints = labels_and_taints(kube)
    assert READY_LABEL not in labels
    assert taints == [GPU, PENDING]


async def test_a_node_without_instance_store_disks_loses_the_startup_taint_and_gets_no_label(
    kube: FakeKube, actions: KubeActions, tmp_path: Path
) -> None:
    result = await prepare_cache(settings_for(tmp_path, None), actions, node_name=NODE, metrics=None)
    assert (result.outcome, result.reason) == (Outcome.ABSENT, NOTHING_TO_DO)
    labels, taints = labels_and_taints(kube)
    assert READY_LABEL not in labels
    assert taints == [GPU]


async def test_a_disabled_cache_touches_no_disk_and_lifts_the_startup_taint(
    kube: FakeKube, actions: KubeActions, tmp_path: Path
) -> None:
    settings = dataclasses.replace(settings_for(tmp_path, str(tmp_path / "missing")), enabled=False)
    result = await prepare_cache(settings, actions, node_name=NODE, metrics=None)
    assert (result.outcome, result.steps) == (Outcome.ABSENT, ())
    assert labels_and_taints(kube)[1] == [GPU]


async def test_spotdrain_cache_exits_non_zero_with_the_failed_step_and_leaves_the_taint(
    kube: FakeKube, kubeconfig: Path, tmp_path: Path
) -> None:
    missing = str(tmp_path / "nvme1n1")
    argv = ["cache", "--model-cache-devices", missing, "--model-cache-path", str(tmp_path / "cache")]
    argv += ["--node-name", NODE, "--kubeconfig", str(kubeconfig)]
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotdrain.cli", *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await process.communicate()
    assert process.returncode == 1
    assert f"spotdrain cache: error: model cache: probe failed on {missing}" in err.decode()
    assert labels_and_taints(kube)[1] == [GPU, PENDING]
