"""The fake Kubernetes API serves watches as the real API server does: JSON lines, resumable, 410 when too old."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch

from simulate.fakes.kube import FakeKube
from simulate.fakes.kube_resources import ENDPOINT_SLICES

SLICES = "/apis/discovery.k8s.io/v1/namespaces/ml/endpointslices"
SELECTOR = "kubernetes.io/service-name=vllm"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(bookmark_every_s=0.2) as kube:
        kube.add_node("n1")
        yield kube


class Stream:
    """A raw watch as any HTTP client sees it: status, headers, and the events line by line."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response

    async def next(self) -> dict[str, Any]:
        async with asyncio.timeout(5):
            line = await self.response.content.readline()
        assert line.endswith(b"\n"), f"the stream ended: {line!r}"
        event: dict[str, Any] = json.loads(line)
        return event

    async def ended(self) -> bool:
        async with asyncio.timeout(5):
            return await self.response.content.read() == b""


async def open_watch(kube: FakeKube, session: aiohttp.ClientSession, path: str, **query: str) -> Stream:
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    response = await session.get(
        kube.url + path,
        params={"watch": "true", **query},
        headers={"Authorization": f"Bearer {kube.token}"},
        ssl=context,
    )
    return Stream(response)


async def listed_version(kube: FakeKube, session: aiohttp.ClientSession, path: str, **query: str) -> str:
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    headers = {"Authorization": f"Bearer {kube.token}"}
    async with session.get(kube.url + path, params=query, headers=headers, ssl=context) as response:
        version: str = (await response.json())["metadata"]["resourceVersion"]
        return version


def ready_of(event: dict[str, Any]) -> bool:
    return bool(event["object"]["endpoints"][0]["conditions"]["ready"])


async def test_kubernetes_asyncio_watches_changes_after_the_lists_resource_version(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, True)])
    configuration = client.Configuration()
    await config.load_kube_config(
        str(kube.write_kubeconfig(tmp_path / "kubeconfig")), client_configuration=configuration
    )
    async with client.ApiClient(configuration) as api:
        discovery: Any = client.DiscoveryV1Api(api)
        listed = await discovery.list_namespaced_endpoint_slice("ml", label_selector=SELECTOR)
        kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, False)])
        kube.store.remove(ENDPOINT_SLICES, "ml", "vllm-0")
        seen = []
        async with watch.Watch() as watcher, asyncio.timeout(5):
            async for event in watcher.stream(
                discovery.list_namespaced_endpoint_slice,
                "ml",
                label_selector=SELECTOR,
                resource_version=listed.metadata.resource_version,
                timeout_seconds=1,
            ):
                seen.append((event["type"], event["object"].endpoints[0].conditions.ready))
                if event["type"] == "DELETED":
                    break
    assert seen == [("MODIFIED", False), ("DELETED", False)]


async def test_a_watch_streams_json_lines_and_starts_with_what_exists_when_no_version_is_given(
    kube: FakeKube,
) -> None:
    kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, True)])
    async with aiohttp.ClientSession() as session:
        stream = await open_watch(kube, session, SLICES, labelSelector=SELECTOR)
        assert stream.response.status == 200
        assert stream.response.headers["Content-Type"] == "application/json;stream=watch"
        added = await stream.next()
        assert (added["type"], added["object"]["kind"], ready_of(added)) == ("ADDED", "EndpointSlice", True)
        kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, False)])
        modified = await stream.next()
        assert (modified["type"], ready_of(modified)) == ("MODIFIED", False)
        assert int(modified["object"]["metadata"]["resourceVersion"]) > int(
            added["object"]["metadata"]["resourceVersion"]
        )
        stream.response.close()


async def test_a_watch_from_a_resource_version_replays_every_change_after_it(kube: FakeKube) -> None:
    kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, True)])
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, SLICES, labelSelector=SELECTOR)
        kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, False)])
        kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, True)])
        stream = await open_watch(kube, session, SLICES, labelSelector=SELECTOR, resourceVersion=version)
        assert [ready_of(await stream.next()) for _ in range(2)] == [False, True]
        stream.response.close()


async def test_a_too_old_resource_version_is_a_410_status_in_an_error_event_then_the_end(kube: FakeKube) -> None:
    kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, True)])
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, SLICES, labelSelector=SELECTOR)
        kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, False)])
        kube.store.compact()
        stream = await open_watch(kube, session, SLICES, labelSelector=SELECTOR, resourceVersion=version)
        assert stream.response.status == 200  # the error comes in the stream, as the cacher sends it
        error = await stream.next()
        assert await stream.ended()
    assert error["type"] == "ERROR"
    status = error["object"]
    assert (status["kind"], status["status"], status["reason"], status["code"]) == ("Status", "Failure", "Expired", 410)
    assert status["message"].startswith(f"too old resource version: {version} (")


async def test_an_object_leaving_a_field_selector_is_deleted_for_that_watch_and_one_entering_added(
    kube: FakeKube,
) -> None:
    kube.add_node("n2")
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, "/api/v1/nodes", fieldSelector="metadata.name=n1")
        stream = await open_watch(
            kube, session, "/api/v1/nodes", fieldSelector="metadata.name=n1", resourceVersion=version
        )
        kube.annotate_node("n2", {"a": "b"})  # not selected: nothing
        kube.annotate_node("n1", {"spotdrain.io/termination-time": "2026-12-01T10:00:00Z"})
        modified = await stream.next()
        kube.replace_node("n1", provider_id="aws:///us-east-1a/i-new")
        deleted, added = await stream.next(), await stream.next()
        stream.response.close()
    assert (modified["type"], modified["object"]["metadata"]["name"]) == ("MODIFIED", "n1")
    assert modified["object"]["metadata"]["annotations"] == {"spotdrain.io/termination-time": "2026-12-01T10:00:00Z"}
    assert (deleted["type"], deleted["object"]["metadata"]["uid"]) == ("DELETED", modified["object"]["metadata"]["uid"])
    assert int(deleted["object"]["metadata"]["resourceVersion"]) > int(
        modified["object"]["metadata"]["resourceVersion"]
    )
    assert (added["type"], added["object"]["spec"]["providerID"]) == ("ADDED", "aws:///us-east-1a/i-new")


async def test_a_label_change_that_leaves_the_selector_is_a_deletion_at_the_new_version(kube: FakeKube) -> None:
    kube.set_endpoints("ml", "vllm", [("10.0.0.1", 8000, True)])
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, SLICES, labelSelector=SELECTOR)
        stream = await open_watch(kube, session, SLICES, labelSelector=SELECTOR, resourceVersion=version)
        stored = kube.store.get(ENDPOINT_SLICES, "ml", "vllm-0")
        stored["metadata"]["labels"] = {"kubernetes.io/service-name": "other"}
        written = kube.store.update(ENDPOINT_SLICES, stored)
        deleted = await stream.next()
        stream.response.close()
    assert deleted["type"] == "DELETED"
    assert deleted["object"]["metadata"]["labels"] == {"kubernetes.io/service-name": "vllm"}  # as it was
    assert deleted["object"]["metadata"]["resourceVersion"] == written["metadata"]["resourceVersion"]


async def test_a_watch_ends_cleanly_at_its_timeout_with_a_bookmark_of_the_version_reached(kube: FakeKube) -> None:
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, "/api/v1/nodes")
        stream = await open_watch(
            kube, session, "/api/v1/nodes", resourceVersion=version, timeoutSeconds="1", allowWatchBookmarks="true"
        )
        kube.add_node("n2")
        added = await stream.next()
        bookmark = await stream.next()
        rest = await stream.response.content.read()  # a clean end of the chunked body, else this raises
    assert added["type"] == "ADDED"
    assert bookmark == {
        "type": "BOOKMARK",
        "object": {"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": str(kube.store.revision)}},
    }
    assert all(json.loads(line)["type"] == "BOOKMARK" for line in rest.splitlines())


async def test_a_watch_without_bookmarks_asked_for_sends_none(kube: FakeKube) -> None:
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, "/api/v1/nodes")
        stream = await open_watch(kube, session, "/api/v1/nodes", resourceVersion=version, timeoutSeconds="1")
        assert await stream.ended()


async def test_dropped_watches_lose_their_connection_and_silenced_ones_go_quiet(kube: FakeKube) -> None:
    async with aiohttp.ClientSession() as session:
        version = await listed_version(kube, session, "/api/v1/nodes")
        dropped = await open_watch(kube, session, "/api/v1/nodes", resourceVersion=version)
        while not kube.watches.open:
            await asyncio.sleep(0.01)
        kube.watches.drop()
        with pytest.raises(aiohttp.ClientPayloadError):
            await dropped.response.content.read()
        quiet = await open_watch(kube, session, "/api/v1/nodes", resourceVersion=version)
        while not kube.watches.open:
            await asyncio.sleep(0.01)
        kube.watches.silence()
        kube.add_node("n2")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await quiet.response.content.readline()
        quiet.response.close()


async def test_a_watch_needs_the_watch_verb_and_a_numeric_resource_version(kube: FakeKube) -> None:
    token = kube.issue_token("system:serviceaccount:ml:gw", denied=[("watch", "nodes")])
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    async with aiohttp.ClientSession() as session:
        query = {"watch": "true"}
        headers = {"Authorization": f"Bearer {token}"}
        async with session.get(f"{kube.url}/api/v1/nodes", params=query, headers=headers, ssl=context) as response:
            assert response.status == 403
        async with session.get(f"{kube.url}/api/v1/nodes", headers=headers, ssl=context) as response:
            assert response.status == 200  # list is another verb
        headers = {"Authorization": f"Bearer {kube.token}"}
        query = {"watch": "true", "resourceVersion": "abc"}
        async with session.get(f"{kube.url}/api/v1/nodes", params=query, headers=headers, ssl=context) as response:
            assert response.status == 400
