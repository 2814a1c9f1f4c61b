"""The node handler when calls fail in every way a network and an API server can make them fail: at its own seam."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from agent.drain.handler import NodeHandler
from agent.drain.progress import Progress, Watched
from agent.notices.notice import Kind
from spotdrain.retry import ApiError
from tests.unit.test_handler import RecordingAck, RecordingActions, handler_for, spot


class FaultyActions(RecordingActions):
    """Recording actions whose calls first raise what ``raises`` lists for them, whatever the exception class; they
    note when each eviction was asked for and what the notice board showed when the node was patched."""

    def __init__(self) -> None:
        super().__init__()
        self.raises: dict[str, list[Exception]] = {}
        self.evicted_at: list[float] = []
        self.board_at_patch: list[set[str]] = []
        self.handler: NodeHandler | None = None
        self.hang: set[str] = set()
        self.released = asyncio.Event()  # what hung calls wait for

    async def _fault(self, call: str) -> None:
        if call in self.hang:
            await self.released.wait()
        if self.raises.get(call):
            raise self.raises[call].pop(0)

    async def get_node(self, name: str) -> dict[str, Any] | None:
        await self._fault("get_node")
        return await super().get_node(name)

    async def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        if self.handler is not None and self.handler.board is not None:
            self.board_at_patch.append(set(self.handler.board.by_node))
        await self._fault("patch_node")
        return await super().patch_node(name, patch)

    async def pods_on(self, node: str) -> list[dict[str, Any]]:
        await self._fault("pods_on")
        return await super().pods_on(node)

    async def evict(self, namespace: str, name: str, *, grace_s: int) -> None:
        self.evicted_at.append(asyncio.get_running_loop().time())
        await self._fault("evict")
        await super().evict(namespace, name, grace_s=grace_s)


@pytest.fixture
def actions() -> FaultyActions:
    fake = FaultyActions()
    fake.add_node("gpu-1", "i-0abc")
    fake.add_pod("vllm-0", "gpu-1")
    fake.add_pod("vllm-1", "gpu-1")
    return fake


def unavailable(count: int) -> list[Exception]:
    return [ApiError(503, "unavailable") for _ in range(count)]


@pytest.mark.looptime
async def test_each_call_retries_on_a_schedule_of_its_own(actions: FaultyActions) -> None:
    actions.raises = {"patch_node": unavailable(3), "pods_on": unavailable(2)}
    handler, _, _ = handler_for(actions)
    await handler.handle(spot())
    # The patch waits 0.2 + 0.5 + 1 s, the pod list 0.2 + 0.5 s (not the 2 + 5 s the patch's schedule had reached),
    # then the 1 s eviction delay.
    assert min(actions.evicted_at) == pytest.approx(3.4, abs=0.1)
    assert set(actions.pods) == set()


@pytest.mark.looptime
async def test_the_sidecars_see_the_notice_before_the_node_is_patched(actions: FaultyActions) -> None:
    handler, board, _ = handler_for(actions)
    actions.handler = handler
    await handler.handle(spot())
    assert actions.board_at_patch == [{"gpu-1"}]
    assert board.by_node["gpu-1"].kind is Kind.SPOT_INTERRUPTION


FAILURES = [
    aiohttp.ServerDisconnectedError(),
    ValueError("Expecting value: line 1 column 1 (char 0)"),
    KeyError("items"),
    RuntimeError("anything else"),
]


@pytest.mark.looptime
@pytest.mark.parametrize("failure", FAILURES, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("call", ["get_node", "patch_node", "pods_on", "evict"])
async def test_whatever_a_call_raises_the_notice_stays_pending_until_acted_on(
    actions: FaultyActions, call: str, failure: Exception
) -> None:
    actions.raises = {call: [failure, failure]}
    ack = RecordingAck()
    handler, _, _ = handler_for(actions)
    await handler.handle(spot(ack=ack))
    assert actions.nodes["gpu-1"]["spec"]["unschedulable"] is True
    assert set(actions.pods) == set(), "every pod evicted, the one whose eviction failed too"
    assert ack.said == ["succeeded"]
    assert asyncio.get_running_loop().time() < 10


@pytest.mark.looptime
async def test_liveness_fails_while_a_notice_in_hand_makes_no_progress(actions: FaultyActions) -> None:
    progress = Progress(stall_s=30)
    handler, _, _ = handler_for(Watched(actions, progress))
    handler.progress = progress
    assert await progress.live() == (True, "ok")
    actions.hang = {"get_node"}
    task = asyncio.create_task(handler.handle(spot()))
    await asyncio.sleep(29)
    assert (await progress.live())[0] is True
    await asyncio.sleep(2)
    ok, reason = await progress.live()
    assert not ok
    assert "no progress for 31" in reason
    actions.released.set()
    await task
    assert set(actions.pods) == set()
    assert await progress.live() == (True, "ok"), "no notice in hand: nothing is stuck"


@pytest.mark.looptime
async def test_a_long_drain_that_keeps_calling_stays_live(actions: FaultyActions) -> None:
    progress = Progress(stall_s=10)
    actions.pdb_blocks_until = 60.0
    handler, _, _ = handler_for(Watched(actions, progress))
    handler.progress = progress
    task = asyncio.create_task(handler.handle(spot()))
    for _ in range(12):
        await asyncio.sleep(5)
        assert (await progress.live())[0] is True
    await task
    assert set(actions.pods) == set()
