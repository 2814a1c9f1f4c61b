"""The kubelet's two duties the tests rely on, for the real API server where no kubelet runs: finishing a graceful
pod deletion once its grace period has passed, and writing the Ready condition a pod's readiness gates give it
(pkg/kubelet/status/generate.go, which ``simulate.fakes.kube_objects.ready_condition`` follows)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import ssl
from collections.abc import Awaitable
from typing import Any

import aiohttp

from simulate.fakes import kube_objects
from simulate.fakes.kube_api import DeleteHook, Deletion
from spotdrain.clock import utcnow
from tests.control_plane import ControlPlane
from tests.real_kube_http import TIMEOUT_S, RecordingProxy

Obj = dict[str, Any]


class Kubelet:
    """Watches every pod: finishes a graceful deletion once its grace period has passed (or a deletion hook
    removed it sooner), and writes the Ready condition a pod's readiness gates give it."""

    def __init__(self, plane: ControlPlane, proxy: RecordingProxy) -> None:
        self.plane = plane
        self.proxy = proxy
        self.hooks: list[DeleteHook] = []
        self.deletions: list[Deletion] = []
        self._graces: dict[tuple[str, str], int] = {}
        self.removing: set[tuple[str, str]] = set()  # its own immediate deletions: not a deletion a client began
        self._tasks: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._watching: asyncio.Task[None] | None = None

    async def start(self) -> None:
        context = ssl.create_default_context(cafile=str(self.plane.ca_path))
        headers = {"Authorization": f"Bearer {self.plane.admin_token}"}
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context), headers=headers)
        listed = await self._get("/api/v1/pods")
        self._watching = asyncio.create_task(self._watch(listed["metadata"]["resourceVersion"]))

    async def stop(self) -> None:
        for task in [*self._tasks, *([self._watching] if self._watching else [])]:
            task.cancel()
        await asyncio.gather(*self._tasks, *([self._watching] if self._watching else []), return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _get(self, path: str) -> Obj:
        assert self._session is not None
        async with self._session.get(self.plane.url + path, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as got:
            answer: Obj = await got.json()
            return answer

    async def _watch(self, version: str) -> None:
        """Returns only when cancelled: the watch is resumed from the last version it saw."""
        assert self._session is not None
        while True:
            url = f"{self.plane.url}/api/v1/pods?watch=1&allowWatchBookmarks=true&resourceVersion={version}"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=None, sock_read=60)) as stream:
                    async for line in stream.content:
                        event = json.loads(line)
                        version = event["object"]["metadata"].get("resourceVersion", version)
                        if event["type"] in ("ADDED", "MODIFIED"):
                            await self._saw(event["object"])
            await asyncio.sleep(0.1)

    async def _saw(self, pod: Obj) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if meta.get("deletionTimestamp") and key not in self.removing:
            grace = int(meta.get("deletionGracePeriodSeconds") or 0)
            if grace < self._graces.get(key, grace + 1):
                self._graces[key] = grace
                self._begin(pod, grace)
        elif pod["spec"].get("readinessGates"):
            ready = kube_objects.ready_condition(pod)
            now: Obj = next((c for c in pod["status"].get("conditions", []) if c["type"] == "Ready"), {})
            if now.get("status") != ready["status"]:
                self._spawn(self._write_ready(pod))

    def _begin(self, pod: Obj, grace: int) -> None:
        namespace, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.deletions.append(Deletion(namespace, name, grace, self.proxy.saw_eviction(namespace, name)))
        for hook in self.hooks:
            result = hook(pod, grace)
            if inspect.isawaitable(result):
                self._spawn(_awaited(result))
        self._spawn(self._remove_after(namespace, name, grace, pod["metadata"]["uid"]))

    async def _remove_after(self, namespace: str, name: str, grace: int, uid: str) -> None:
        await asyncio.sleep(grace)
        if self._graces.get((namespace, name)) != grace:
            return  # shortened since: a newer timer removes it
        self.removing.add((namespace, name))
        assert self._session is not None
        body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
        with contextlib.suppress(aiohttp.ClientError):
            path = f"{self.plane.url}/api/v1/namespaces/{namespace}/pods/{name}"
            async with self._session.delete(path, json=body, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)):
                pass

    async def _write_ready(self, pod: Obj) -> None:
        assert self._session is not None
        meta = pod["metadata"]
        changed = kube_objects.with_ready_condition(pod, now=utcnow())
        path = f"{self.plane.url}/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
        with contextlib.suppress(aiohttp.ClientError):  # a conflict: the newer version's event comes next
            async with self._session.put(path, json=changed, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)):
                pass

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _awaited(result: Awaitable[Any]) -> None:
    await result
