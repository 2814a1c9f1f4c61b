"""``spotdrain node`` (IMDS mode, in this process) when one API call or one IMDS answer misbehaves: nothing is lost."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from agent.notices.imds import ImdsSource
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, status_of
from spotdrain.clock import utcnow
from tests.conftest import until
from tests.integration.test_node_agent import GPU_TAINT, INSTANCE, agent, containers_exit_soon, cordoned

NODE_PATH = r"^/api/v1/nodes/gpu-1$"
EVICTION_PATH = r"/pods/vllm-0/eviction$"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as fake:
        fake.add_node("gpu-1", provider_id=f"aws:///us-east-1a/{INSTANCE}", taints=[GPU_TAINT])
        fake.add_pod("ml", "vllm-0", node="gpu-1", owner_kind="ReplicaSet", grace_period_s=130)
        fake.add_pod("ml", "vllm-1", node="gpu-1", owner_kind="ReplicaSet", grace_period_s=130)
        fake.add_pod("ml", "other-node-pod", node="gpu-2")
        fake.on_delete(containers_exit_soon(fake))
        yield fake


def drained(kube: FakeKube) -> bool:
    return cordoned(kube) and kube.pod("ml", "vllm-0") is None and kube.pod("ml", "vllm-1") is None


FAULTS: dict[str, dict[str, Any]] = {
    "hung-patch": dict(kind="hang", method="PATCH", path=NODE_PATH),
    "hung-patch-applied": dict(kind="hang", method="PATCH", path=NODE_PATH, applied=True),
    "hung-node-read": dict(kind="hang", method="GET", path=NODE_PATH, skip=1),  # the startup check reads it first
    "dropped-patch-applied": dict(kind="drop", method="PATCH", path=NODE_PATH, applied=True),
    "dropped-patch": dict(kind="drop", method="PATCH", path=NODE_PATH),
    "dropped-eviction": dict(kind="drop", method="POST", path=EVICTION_PATH),
    "dropped-eviction-applied": dict(kind="drop", method="POST", path=EVICTION_PATH, applied=True),
    "hung-eviction": dict(kind="hang", method="POST", path=EVICTION_PATH),
    "garbage-pod-list": dict(kind="garbage", method="GET", path=r"^/api/v1/pods$"),
    "garbage-patch-applied": dict(kind="garbage", method="PATCH", path=NODE_PATH, applied=True, garbage=1),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_one_misbehaving_call_loses_no_notice(kube: FakeKube, tmp_path: Path, fault: str) -> None:
    kube.faults.inject(**FAULTS[fault])
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    with capture_logs() as logs:
        async with serving(imds) as url, agent(kube, url, tmp_path, "--api-timeout", "0.5"):
            await until(lambda: drained(kube))
    assert [s.kind for s in kube.faults.struck] == [FAULTS[fault]["kind"]]
    assert kube.pod("ml", "other-node-pod") is not None
    assert not any(e["event"] in ("notice.handler_failed", "task.failed") for e in logs)
    # A patch applied whose answer was lost still gets its one Event.
    assert [e["reason"] for e in kube.events()] == ["InterruptionNotice"]


async def test_a_hung_event_write_does_not_hold_up_the_evictions(kube: FakeKube, tmp_path: Path) -> None:
    kube.faults.inject("hang", "POST", r"/events$")
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    async with serving(imds) as url, agent(kube, url, tmp_path, "--api-timeout", "60"):
        await until(lambda: drained(kube), timeout_s=10)
        assert [s.kind for s in kube.faults.struck] == ["hang"], "the Event is still being written"
        assert kube.events() == []


async def test_livez_fails_while_a_notice_makes_no_progress_and_recovers(kube: FakeKube, tmp_path: Path) -> None:
    kube.faults.inject("hang", "PATCH", NODE_PATH)
    imds = FakeImds(instance_id=INSTANCE)
    port = free_port()
    flags = ("--api-timeout", "3", "--progress-timeout", "0.5", "--metrics-port", str(port))
    async with serving(imds) as url, agent(kube, url, tmp_path, *flags):
        livez = f"http://127.0.0.1:{port}/livez"
        assert await status_of(livez) == (200, "ok\n")
        imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
        await until(lambda: bool(kube.faults.struck))
        await asyncio.sleep(0.7)
        status, reason = await status_of(livez)
        assert (status, reason.startswith("1 notice(s) in hand and no progress")) == (503, True)
        await until(lambda: drained(kube))  # the hung PATCH timed out at 3 s and went again on a new connection
        assert (await status_of(livez))[0] == 200


async def test_an_imds_notice_handed_back_is_yielded_again_until_its_deadline() -> None:
    imds = FakeImds(instance_id=INSTANCE)
    deadline = utcnow() + timedelta(seconds=120)
    imds.schedule_spot("terminate", deadline)
    now = [utcnow()]
    async with serving(imds) as url, aiohttp.ClientSession() as session:
        source = ImdsSource(session=session, base_url=url, interval_s=0.05, clock=lambda: now[0])
        notices = source.notices()
        first = await asyncio.wait_for(anext(notices), 5)
        assert first.ack is not None
        await first.ack.retry("the handler failed")
        again = await asyncio.wait_for(anext(notices), 5)
        assert again.id == first.id
        assert again.ack is not None
        now[0] = deadline
        await again.ack.retry("gave up at the deadline")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(anext(notices), 0.5)


async def test_the_sidecars_see_the_notice_before_the_node_is_patched(kube: FakeKube, tmp_path: Path) -> None:
    # The PATCH is applied and its answer never comes: the notice must already be on the notice endpoint.
    kube.faults.inject("hang", "PATCH", NODE_PATH, applied=True)
    imds = FakeImds(instance_id=INSTANCE)
    async with serving(imds) as url, agent(kube, url, tmp_path, "--api-timeout", "5") as notice_port:
        imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
        await until(lambda: cordoned(kube))
        status, body = await status_of(f"http://127.0.0.1:{notice_port}/v1/notice")
        assert (status, '"kind": "spot-interruption"' in body) == (200, True)
