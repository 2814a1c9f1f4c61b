"""The gateway's list-then-watch against the fake API server: every change arrives, through drops, 410s and silence."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.endpoints import NODES_PATH, SLICES_PATH, ready_urls
from gateway.watch import Obj, WatchTimeouts, follow
from simulate.fakes.kube import Call, FakeKube
from spotdrain.kube_rest import InCluster
from tests.conftest import Kube

PATH = SLICES_PATH.format(namespace="ml")
QUERY = {"labelSelector": "kubernetes.io/service-name=vllm"}
TIMEOUTS = WatchTimeouts(request_s=5, watch_s=30, silence_s=30)
# Addresses only reported, never connected to: the API server refuses loopback ones in an EndpointSlice
# ("may not be in the loopback range", pkg/apis/discovery/validation).
BOTH_READY = [("10.0.0.1", 8001, True), ("10.0.0.1", 8002, True)]
FIRST_DRAINING = [("10.0.0.1", 8001, False), ("10.0.0.1", 8002, True)]


class Snapshots:
    """What ``follow`` reported, in order; ``next()`` waits for the next report."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[Obj]] = asyncio.Queue()

    def __call__(self, items: list[Obj]) -> None:
        self.queue.put_nowait(items)

    async def next(self) -> list[str]:
        async with asyncio.timeout(10):
            return ready_urls(await self.queue.get(), port=None)


@asynccontextmanager
async def following(kube: Kube, tmp_path: Path, *, timeouts: WatchTimeouts = TIMEOUTS) -> AsyncIterator[Snapshots]:
    cluster = InCluster.from_environment(kube.serviceaccount_dir(tmp_path / "sa"), env=kube.service_env())
    snapshots = Snapshots()
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(follow(session, cluster, PATH, query=QUERY, on_change=snapshots, timeouts=timeouts))
        try:
            yield snapshots
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


def slice_calls(kube: Kube, *, watch: bool) -> list[Call]:
    pattern = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    return [c for c in kube.calls if c.pattern == pattern and (c.query.get("watch") == "true") == watch]


def open_watches(kube: Kube) -> int:
    return len(kube.watches.open) if isinstance(kube, FakeKube) else kube.proxy.open_watches


async def watching(kube: Kube, count: int = 1) -> None:
    """Until ``count`` watches are open on the API server (a condition, not a pause)."""
    async with asyncio.timeout(10):
        while open_watches(kube) < count:
            await asyncio.sleep(0.01)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.set_endpoints("ml", "vllm", BOTH_READY)
        yield kube


@pytest.fixture
def any_slices(any_kube: Kube) -> Kube:
    """The Service's two ready endpoints, on the fake and on the real API server."""
    any_kube.set_endpoints("ml", "vllm", BOTH_READY)
    return any_kube


async def test_a_readiness_flip_reaches_the_follower_on_the_open_watch(any_slices: Kube, tmp_path: Path) -> None:
    kube = any_slices
    async with following(kube, tmp_path) as snapshots:
        assert await snapshots.next() == ["http://10.0.0.1:8001", "http://10.0.0.1:8002"]
        listed = [s for s in kube.calls if s.pattern.endswith("/endpointslices") and "watch" not in s.query]
        await watching(kube)
        kube.set_endpoints("ml", "vllm", FIRST_DRAINING)
        assert await snapshots.next() == ["http://10.0.0.1:8002"]
    assert len(slice_calls(kube, watch=False)) == len(listed) == 1
    [watch] = slice_calls(kube, watch=True)  # the change came on the first watch: nothing polled
    if isinstance(kube, FakeKube):
        assert watch.query["resourceVersion"] == str(kube.store.revision - 1)
    else:  # the list's version is the etcd revision, which other writers move; it is a number all the same
        assert int(watch.query["resourceVersion"]) > 0
    assert watch.query["allowWatchBookmarks"] == "true"
    assert watch.query["timeoutSeconds"] == "30"
    assert watch.query["labelSelector"] == QUERY["labelSelector"]


async def test_a_dropped_watch_resumes_from_its_last_version_and_loses_no_change(
    kube: FakeKube, tmp_path: Path
) -> None:
    async with following(kube, tmp_path) as snapshots:
        await snapshots.next()
        await watching(kube)
        kube.watches.drop()
        kube.set_endpoints("ml", "vllm", FIRST_DRAINING)  # while no watch is connected
        assert await snapshots.next() == ["http://10.0.0.1:8002"]
    assert len(slice_calls(kube, watch=False)) == 1
    first, resumed = slice_calls(kube, watch=True)
    assert first.query["resourceVersion"] == resumed.query["resourceVersion"]  # nothing came between: the same


async def test_a_watch_too_old_to_resume_lists_again(kube: FakeKube, tmp_path: Path) -> None:
    async with following(kube, tmp_path) as snapshots:
        await snapshots.next()
        await watching(kube)
        kube.add_node("elsewhere")  # the cluster moves on, in what this watch does not see
        kube.store.compact()
        kube.watches.drop()
        kube.set_endpoints("ml", "vllm", FIRST_DRAINING)
        assert await snapshots.next() == ["http://10.0.0.1:8002"]
    assert len(slice_calls(kube, watch=False)) == 2
    first, refused = slice_calls(kube, watch=True)[:2]
    assert refused.query["resourceVersion"] == first.query["resourceVersion"]  # answered 410, then the list


async def test_a_silent_watch_is_restarted_and_delivers_what_it_withheld(kube: FakeKube, tmp_path: Path) -> None:
    quick = WatchTimeouts(request_s=5, watch_s=30, silence_s=0.3)
    async with following(kube, tmp_path, timeouts=quick) as snapshots:
        await snapshots.next()
        await watching(kube)
        kube.watches.silence()  # the connection stays open; nothing more comes through it
        kube.set_endpoints("ml", "vllm", FIRST_DRAINING)
        assert await snapshots.next() == ["http://10.0.0.1:8002"]
    assert len(slice_calls(kube, watch=False)) == 1
    assert len(slice_calls(kube, watch=True)) == 2


async def test_a_watch_ended_by_its_timeout_resumes_at_once_from_its_bookmark(tmp_path: Path) -> None:
    async with FakeKube(bookmark_every_s=60) as kube:
        kube.set_endpoints("ml", "vllm", BOTH_READY)
        short = WatchTimeouts(request_s=5, watch_s=3, silence_s=8)
        async with following(kube, tmp_path, timeouts=short) as snapshots:
            await snapshots.next()
            await watching(kube)
            kube.add_node("elsewhere")  # moves the version on; the bookmark 2 s before the end carries it
            async with asyncio.timeout(10):
                while len(slice_calls(kube, watch=True)) < 2:
                    await asyncio.sleep(0.05)
            kube.set_endpoints("ml", "vllm", FIRST_DRAINING)
            assert await snapshots.next() == ["http://10.0.0.1:8002"]
        first, resumed = slice_calls(kube, watch=True)[:2]
    assert int(resumed.query["resourceVersion"]) > int(first.query["resourceVersion"])
    assert len(slice_calls(kube, watch=False)) == 1


@pytest.mark.parametrize("fault", ["status", "garbage", "drop", "hang"])
async def test_a_failing_watch_keeps_what_is_known_and_comes_back(kube: FakeKube, tmp_path: Path, fault: str) -> None:
    quick = WatchTimeouts(request_s=5, watch_s=30, silence_s=0.5)  # a hung watch request gives up after this
    async with following(kube, tmp_path, timeouts=quick) as snapshots:
        await snapshots.next()
        await watching(kube)
        kube.faults.inject(fault, "GET", "endpointslices", count=2, status=500)
        kube.watches.drop()
        kube.set_endpoints("ml", "vllm", FIRST_DRAINING)
        assert await snapshots.next() == ["http://10.0.0.1:8002"]  # nothing reported in between
    assert [s.kind for s in kube.faults.struck] == [fault, fault]
    assert len(slice_calls(kube, watch=False)) == 1


async def test_a_node_watch_reports_the_nodes_annotation(any_kube: Kube, tmp_path: Path) -> None:
    kube = any_kube
    kube.add_node("gpu-1")
    kube.add_node("gpu-2")
    cluster = InCluster.from_environment(kube.serviceaccount_dir(tmp_path / "sa"), env=kube.service_env())
    seen: asyncio.Queue[list[Any]] = asyncio.Queue()
    async with aiohttp.ClientSession() as session:
        query = {"fieldSelector": "metadata.name=gpu-1"}
        task = asyncio.create_task(
            follow(session, cluster, NODES_PATH, query=query, on_change=seen.put_nowait, timeouts=TIMEOUTS)
        )
        try:
            async with asyncio.timeout(10):
                assert [n["metadata"]["name"] for n in await seen.get()] == ["gpu-1"]
                await watching(kube)
                kube.annotate_node("gpu-2", {"spotdrain.io/termination-time": "2026-12-01T10:00:00Z"})
                kube.annotate_node("gpu-1", {"spotdrain.io/termination-time": "2026-12-01T10:02:00Z"})
                [node] = await seen.get()
        finally:
            task.cancel()
    assert node["metadata"]["annotations"] == {"spotdrain.io/termination-time": "2026-12-01T10:02:00Z"}
    assert seen.empty()  # gpu-2's change never reached this watch
