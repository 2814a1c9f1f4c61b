"""List, then watch, one Kubernetes collection, with plain aiohttp: what is known of it, kept current.

The protocol (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes): a list
answers the items and the collection's ``resourceVersion``; a watch from it streams every later change, one JSON
object a line, ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``. A watch that ends (its
``timeoutSeconds``, a dropped connection) resumes from the last ``resourceVersion`` seen, which loses nothing; an
ERROR whose ``Status`` has code 410 ("too old resource version") says that history is gone: list again. A BOOKMARK
only moves the ``resourceVersion`` on, so a resumed watch need not replay what its selector filtered out.

Plain aiohttp rather than kubernetes-asyncio: the gateway's image carries only the base dependencies, and importing
kubernetes-asyncio's client and model classes costs about 40 MB of RSS, two thirds again the gateway's own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog

from spotdrain.kube_rest import InCluster
from spotdrain.retry import BACKOFF_S

log = structlog.get_logger()

Obj = dict[str, Any]
MAX_EVENT_BYTES = 16 << 20  # one object a line; an EndpointSlice of 1,000 endpoints is a few hundred KB


@dataclass(frozen=True)
class WatchTimeouts:
    request_s: float  # a whole list; connecting a watch and its first answer
    watch_s: int  # timeoutSeconds: the server ends each watch after this, and it is started again
    silence_s: float  # no byte for this long: the watch is taken as dead and started again


class Expired(Exception):
    """410 Gone: the resourceVersion to resume from is older than the server's history."""


class WatchFailed(Exception):
    """The watch answered an error (a Status that is not a 410), or what is not a watch."""


class Silent(Exception):
    """A watch that had started sent nothing for longer than the server would have kept it open: a dead connection."""


@dataclass
class Known:
    """The collection as last seen: objects by (namespace, name), and the version to resume from (None: list)."""

    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)
    version: str | None = None

    def replace(self, listed: Any) -> None:
        items = listed.get("items") if isinstance(listed, dict) else None
        version = (listed.get("metadata") or {}).get("resourceVersion") if isinstance(listed, dict) else None
        if not isinstance(items, list) or not isinstance(version, str):
            raise WatchFailed("the list answer has no items or no resourceVersion")
        self.objects = {_key(item): item for item in items if isinstance(item, dict)}
        self.version = version

    def apply(self, event: Obj) -> bool:
        """Take one watch event in; True when the objects changed. Raises Expired on a 410, WatchFailed on
        another error or an event that is not one."""
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, dict):
            raise WatchFailed(f"a {kind} event without an object")
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Expired(str(obj.get("message")))
            raise WatchFailed(f"error event: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK") or not isinstance(version, str):
            raise WatchFailed(f"not a watch event: type {kind!r}, resourceVersion {version!r}")
        self.version = version
        if kind == "BOOKMARK":
            return False
        if kind == "DELETED":
            return self.objects.pop(_key(obj), None) is not None
        self.objects[_key(obj)] = obj
        return True


def _key(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def split_lines(buffer: bytearray, data: bytes) -> list[bytes]:
    """The complete lines that ``data`` ends, with what ``buffer`` held before; the rest stays in ``buffer``.

    A line growing past MAX_EVENT_BYTES is refused rather than held.
    """
    end = data.rfind(b"\n")
    if end < 0:
        buffer += data
        if len(buffer) > MAX_EVENT_BYTES:
            raise WatchFailed(f"a watch event over {MAX_EVENT_BYTES} bytes")
        return []
    whole = bytes(buffer) + data[:end]
    buffer[:] = data[end + 1 :]
    return [line for line in whole.split(b"\n") if line.strip()]


def parse_event(line: bytes) -> Obj:
    try:
        event = json.loads(line)
    except ValueError as error:
        raise WatchFailed(f"a watch line that is not JSON: {error}") from None
    if not isinstance(event, dict):
        raise WatchFailed("a watch line that is not an object")
    return event


async def follow(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    path: str,
    *,
    query: dict[str, str],
    on_change: Callable[[list[Obj]], None],
    timeouts: WatchTimeouts,
) -> None:
    """Keeps ``on_change`` told the collection's objects, after the list and after each change; runs until cancelled.

    Failures (the API unreachable, an error answer, garbage) keep what is known and try again after
    ``BACKOFF_S``, its last step repeating; a watch that ended after delivering something resumes at once.
    """
    known = Known()
    failures = 0
    while True:
        listed = known.version is None
        try:
            if listed:
                known.replace(await _list(session, cluster, path, query, timeouts))
                on_change(list(known.objects.values()))
            delivered = await _watch(session, cluster, path, query, known, on_change, timeouts)
            failures = 0 if delivered else failures + 1
        except Expired as error:
            log.info("watch.expired", path=path, error=str(error))
            known.version = None  # list again: at once, unless the version a list just gave is already too old
            failures = failures + 1 if listed else 0
        except Silent:
            log.warning("watch.silent", path=path, silence_s=timeouts.silence_s, version=known.version)
            failures = 0  # a dead connection: watch again from the last version, at once
        except (aiohttp.ClientError, TimeoutError, OSError, WatchFailed) as error:
            failures += 1
            log.warning("watch.failed", path=path, error=str(error) or type(error).__name__, version=known.version)
        if failures:
            await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])


async def _list(
    session: aiohttp.ClientSession, cluster: InCluster, path: str, query: dict[str, str], timeouts: WatchTimeouts
) -> Any:
    timeout = aiohttp.ClientTimeout(total=timeouts.request_s)
    async with session.get(
        cluster.base_url + path, params=query, headers=cluster.headers(), ssl=cluster.ssl_context(), timeout=timeout
    ) as response:
        if response.status != 200:
            raise WatchFailed(f"HTTP {response.status} listing {path}")
        try:
            return json.loads(await response.read())
        except ValueError as error:
            raise WatchFailed(f"the list of {path} is not JSON: {error}") from None


async def _watch(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    path: str,
    query: dict[str, str],
    known: Known,
    on_change: Callable[[list[Obj]], None],
    timeouts: WatchTimeouts,
) -> bool:
    """One watch from ``known.version`` until the server ends it; True if it delivered any event."""
    assert known.version is not None
    params = query | {
        "watch": "true",
        "resourceVersion": known.version,
        "allowWatchBookmarks": "true",
        "timeoutSeconds": str(timeouts.watch_s),
    }
    timeout = aiohttp.ClientTimeout(
        total=None, connect=timeouts.request_s, sock_connect=timeouts.request_s, sock_read=timeouts.silence_s
    )
    delivered = False
    async with session.get(
        cluster.base_url + path, params=params, headers=cluster.headers(), ssl=cluster.ssl_context(), timeout=timeout
    ) as response:
        if response.status == 410:
            raise Expired(f"HTTP 410 watching {path}")
        if response.status != 200:
            raise WatchFailed(f"HTTP {response.status} watching {path}")
        buffer = bytearray()
        try:
            async for data in response.content.iter_any():
                changed = False
                for line in split_lines(buffer, data):
                    changed |= known.apply(parse_event(line))
                    delivered = True
                if changed:
                    on_change(list(known.objects.values()))
        except aiohttp.ServerTimeoutError as error:  # sock_read: no byte for silence_s
            raise Silent(str(error)) from None
    return delivered
