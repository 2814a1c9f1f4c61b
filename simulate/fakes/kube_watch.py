"""Watches of the fake Kubernetes API, served as the real API server serves them.

What the real one does (staging/src/k8s.io/apiserver/pkg/endpoints/handlers/watch.go ``HandleHTTP``, the cacher in
staging/src/k8s.io/apiserver/pkg/storage/cacher, and the API concepts page, "Efficient detection of changes":
https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes):

- ``GET <collection>?watch=true`` answers 200, ``Content-Type: application/json;stream=watch``, chunked, one JSON
  object a line: ``{"type": "ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR", "object": ...}``.
- ``resourceVersion=V`` streams every change after V; unset or ``0`` starts with a synthetic ADDED of each object
  that exists now, then the changes. A V that is not a number is a 400.
- A V older than the history the server still holds: 200 all the same, then one ERROR event whose object is a
  ``Status`` (``reason: Expired``, ``code: 410``), and the stream ends (cacher.go: "once we have passed
  authn/authz/admission, and successfully parsed a resource version, other errors must fail with a watch event of
  type ERROR, rather than a directly returned error"). The message says which history it was: the watch cache's
  ``too old resource version: V (oldest)`` (watch_cache_history.go ``GetIntervalLocked``), or etcd's, for a
  resource with no watch cache (events), ``The resourceVersion for the provided watch is too old.`` (etcd3/errors.go
  ``interpretWatchError`` on a compacted revision; measured on the real API server v1.36.2 after compacting etcd:
  tests/integration/test_kube_contract.py). The client must list again.
- Label and field selectors filter as in a list; an object that stops matching is DELETED for that watch, one that
  starts matching ADDED (cache_watcher.go ``convertToWatchEvent``). A DELETED object carries the deletion's
  ``resourceVersion``.
- ``timeoutSeconds`` ends the stream (cleanly: the chunked body ends) after that long; unset or 0, the server's own
  ``--min-request-timeout`` (1800 s) applies.
- ``allowWatchBookmarks=true``: BOOKMARK events whose object carries only ``kind``, ``apiVersion`` and
  ``metadata.resourceVersion``, roughly every minute and 2 s before the timeout (cache_watcher.go
  ``nextBookmarkTime``). A bookmark is sent only once everything before its version was, and only when that version
  is newer than the one the watch started from: a watch of a quiet store gets none, one that has seen a change gets
  a bookmark at that change's version (measured on the real API server v1.36.2: tests/integration/
  test_kube_contract.py).

Tests steer the open watches: ``drop()`` closes their connections (an API server restart, a load balancer), and
``silence()`` makes them send nothing more while staying open (a NAT entry that died): both are what a watching
client must survive without losing an event.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
from collections.abc import Callable, Mapping

from aiohttp import web

from simulate.fakes.kube_resources import Target
from simulate.fakes.kube_select import (
    KubeError,
    Obj,
    bad_request,
    fields_match,
    flag,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)
from simulate.fakes.kube_store import Change, Store

DEFAULT_TIMEOUT_S = 1800.0  # kube-apiserver --min-request-timeout
BOOKMARK_EVERY_S = 60.0  # cacher.go's bookmarkFrequency
_BOOKMARK_BEFORE_END_S = 2.0


class Watcher:
    """One open watch: what it selects, and the events waiting to be written to it (None: end now)."""

    def __init__(self, target: Target, query: Mapping[str, str], *, show: Callable[[Obj], Obj]) -> None:
        self.target = target
        self.labels = parse_label_selector(query.get("labelSelector", ""))
        self.fields = parse_field_selector(query.get("fieldSelector", ""), target.resource.fields)
        self.show = show
        self.queue: asyncio.Queue[Obj | None] = asyncio.Queue()
        self.silent = False
        self.transport: asyncio.BaseTransport | None = None
        self.version = 0  # the resourceVersion it started from

    def selects(self, obj: Obj) -> bool:
        meta = obj["metadata"]
        if self.target.namespace is not None and meta.get("namespace") != self.target.namespace:
            return False
        return labels_match(self.labels, meta.get("labels")) and fields_match(self.fields, obj)

    def offer(self, change: Change) -> None:
        if change.resource is self.target.resource and (event := self.event(change)) is not None:
            self.queue.put_nowait(event)

    def event(self, change: Change) -> Obj | None:
        """The event this watcher sees of ``change``, if any (convertToWatchEvent)."""
        now = change.type != "DELETED" and self.selects(change.obj)
        before = change.previous is not None and self.selects(change.previous)
        if now:
            return self.shown("MODIFIED" if before else "ADDED", change.obj)
        if change.previous is None or not before:
            return None
        gone = change.obj if change.type == "DELETED" else _at_revision(change.previous, change.revision)
        return self.shown("DELETED", gone)

    def shown(self, kind: str, obj: Obj) -> Obj:
        return {"type": kind, "object": self.show(copy.deepcopy(obj))}


class Watches:
    """The open watches of one fake API server, fed by its store's changes."""

    def __init__(self, store: Store, *, show: Callable[[Obj], Obj], bookmark_every_s: float = BOOKMARK_EVERY_S) -> None:
        self.store = store
        self.show = show
        self.bookmark_every_s = bookmark_every_s
        self.open: set[Watcher] = set()
        store.listeners.append(self._offer)

    def drop(self) -> None:
        """Close the connection of every open watch, with no end to its chunked body."""
        for watcher in list(self.open):
            if watcher.transport is not None:
                watcher.transport.close()
            watcher.queue.put_nowait(None)

    def silence(self) -> None:
        """Every open watch sends nothing more, and stays open until its timeout."""
        for watcher in self.open:
            watcher.silent = True

    def close(self) -> None:
        """The server stops: every watch ends."""
        for watcher in self.open:
            watcher.queue.put_nowait(None)

    async def serve(self, request: web.Request, target: Target, query: Mapping[str, str]) -> web.StreamResponse:
        """One watch, from the request to the end of its stream; errors before the stream starts are KubeError."""
        version = _version(query.get("resourceVersion", ""))
        timeout_s = _timeout(query.get("timeoutSeconds", "")) or DEFAULT_TIMEOUT_S
        watcher = Watcher(target, query, show=self.show)
        # Register and take the backlog in one step: the store changes only between awaits, so nothing is missed.
        backlog = self._backlog(watcher, version)
        watcher.version = self.store.revision if version is None else version
        self.open.add(watcher)
        try:
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/json;stream=watch"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            watcher.transport = request.transport
            for event in backlog:
                await response.write(_line(event))
            if not (backlog and backlog[-1]["type"] == "ERROR"):
                await self._stream(watcher, response, timeout_s, bookmarks=flag(query, "allowWatchBookmarks"))
            await response.write_eof()
        except ConnectionError:
            pass  # the client, or drop(), closed the connection
        finally:
            self.open.discard(watcher)
        return response

    def _backlog(self, watcher: Watcher, version: int | None) -> list[Obj]:
        if version is None:
            items = self.store.items(watcher.target.resource, watcher.target.namespace)
            return [watcher.shown("ADDED", item) for item in items if watcher.selects(item)]
        if version < self.store.oldest() - 1:
            return [{"type": "ERROR", "object": self._expired(watcher, version).status()}]
        resource = watcher.target.resource
        events = (watcher.event(c) for c in self.store.changes if c.revision > version and c.resource is resource)
        return [e for e in events if e is not None]

    async def _stream(
        self, watcher: Watcher, response: web.StreamResponse, timeout_s: float, *, bookmarks: bool
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        bookmark_at = _next_bookmark(loop.time(), deadline, self.bookmark_every_s) if bookmarks else math.inf
        while (now := loop.time()) < deadline:
            try:
                event = await asyncio.wait_for(watcher.queue.get(), min(deadline, bookmark_at) - now)
            except TimeoutError:
                if loop.time() < bookmark_at:
                    continue  # the deadline
                bookmark_at = _next_bookmark(loop.time(), deadline, self.bookmark_every_s)
                if self.store.revision <= watcher.version:
                    continue  # nothing newer than the start to mark
                event = self._bookmark(watcher)
            if event is None:
                raise ConnectionResetError("the watch was dropped")
            if not watcher.silent:
                await response.write(_line(event))

    def _expired(self, watcher: Watcher, version: int) -> KubeError:
        if watcher.target.resource.watch_cache:
            return KubeError(410, "Expired", f"too old resource version: {version} ({self.store.oldest() - 1})")
        return KubeError(410, "Expired", "The resourceVersion for the provided watch is too old.")

    def _bookmark(self, watcher: Watcher) -> Obj:
        resource = watcher.target.resource
        mark = {"kind": resource.kind, "apiVersion": resource.group_version}
        return {"type": "BOOKMARK", "object": mark | {"metadata": {"resourceVersion": str(self.store.revision)}}}

    def _offer(self, change: Change) -> None:
        for watcher in self.open:
            watcher.offer(change)


def _at_revision(obj: Obj, revision: int) -> Obj:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(revision)}}


def _line(event: Obj) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _version(text: str) -> int | None:
    """None: start from the current state (unset, or "0": any version will do)."""
    if text in ("", "0"):
        return None
    try:
        return int(text)
    except ValueError:
        raise bad_request(f"resourceVersion: Invalid value: {text!r}: must be a number") from None


def _timeout(text: str) -> float:
    if not text:
        return 0.0
    try:
        return float(max(0, int(text)))
    except ValueError:
        raise bad_request(f"timeoutSeconds: Invalid value: {text!r}") from None


def _next_bookmark(now: float, deadline: float, every_s: float) -> float:
    before_end = deadline - _BOOKMARK_BEFORE_END_S
    return before_end if now < before_end < now + every_s else now + every_s
