"""The node agent's Kubernetes calls when the connection misbehaves: against the fake API server's faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from agent.drain.nodes import KubeActions, api_client
from simulate.fakes.kube import FakeKube
from spotdrain.ratelimit import RateLimiter
from spotdrain.retry import ApiError, retrying

TIMEOUT_S = 0.5


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        kube.add_pod("ml", "vllm-0", node="gpu-1")
        yield kube


@pytest.fixture
async def actions(kube: FakeKube, tmp_path: Path) -> AsyncIterator[KubeActions]:
    errors: list[ApiError] = []
    async with api_client(str(kube.write_kubeconfig(tmp_path / "kubeconfig"))) as api:
        kube_actions = KubeActions(
            api, limiter=RateLimiter(qps=1000, burst=1000), on_error=errors.append, timeout_s=TIMEOUT_S
        )
        try:
            yield kube_actions
        finally:
            await kube_actions.close()


async def test_a_call_that_is_never_answered_times_out(kube: FakeKube, actions: KubeActions) -> None:
    kube.faults.inject("hang", "GET", r"^/api/v1/nodes/gpu-1$")
    with pytest.raises(ApiError) as raised:
        await asyncio.wait_for(actions.get_node("gpu-1"), TIMEOUT_S * 10)
    assert raised.value.kind == "timeout"
    assert raised.value.transient
    assert (await actions.get_node("gpu-1") or {})["metadata"]["name"] == "gpu-1"


async def test_once_pooled_connections_went_silent_the_retry_opens_a_new_one(
    kube: FakeKube, actions: KubeActions
) -> None:
    # Three connections in the pool, then all of them die behind a NAT: requests on them are never answered.
    kube.latency_s = 0.1
    await asyncio.gather(*(actions.get_node("gpu-1") for _ in range(3)))
    kube.latency_s = 0.0
    kube.faults.silence()
    node = await asyncio.wait_for(
        retrying(lambda: actions.get_node("gpu-1"), what="node.read", backoff_s=(0.01,)), TIMEOUT_S * 10
    )
    assert node is not None
    assert [s.kind for s in kube.faults.struck] == ["silent"], "one silent connection, then a new one"


@pytest.mark.parametrize("applied", [False, True])
async def test_a_connection_dropped_on_a_write_is_a_transient_api_error(
    kube: FakeKube, actions: KubeActions, applied: bool
) -> None:
    kube.faults.inject("drop", "POST", r"/eviction$", applied=applied)
    with pytest.raises(ApiError) as raised:
        await actions.evict("ml", "vllm-0", grace_s=30)
    assert raised.value.kind == "unreachable"
    assert raised.value.transient
    assert len(kube.deletions) == applied
    await actions.evict("ml", "vllm-0", grace_s=30)  # sent again: the pod's deletion starts, or goes on
    assert len(kube.deletions) == 1


@pytest.mark.parametrize("variant", [0, 1], ids=["html", "cut-off-json"])
@pytest.mark.parametrize("call", ["get_node", "pods_on", "patch_node"])
async def test_a_200_that_is_not_the_json_asked_for_is_a_malformed_api_error(
    kube: FakeKube, actions: KubeActions, variant: int, call: str
) -> None:
    kube.faults.inject("garbage", "*", r"^/api/v1/(nodes/gpu-1|pods)$", garbage=variant)
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "get_node": lambda: actions.get_node("gpu-1"),
        "pods_on": lambda: actions.pods_on("gpu-1"),
        "patch_node": lambda: actions.patch_node("gpu-1", {"metadata": {"labels": {"a": "b"}}}),
    }
    with pytest.raises(ApiError) as raised:
        await calls[call]()
    assert raised.value.kind == "malformed"
    assert raised.value.transient
    await calls[call]()


async def test_injected_statuses_carry_retry_after(kube: FakeKube, actions: KubeActions) -> None:
    kube.faults.inject("status", "POST", r"/eviction$", status=429, retry_after_s=3)
    with pytest.raises(ApiError) as raised:
        await actions.evict("ml", "vllm-0", grace_s=30)
    assert (raised.value.status, raised.value.retry_after_s) == (429, 3.0)
