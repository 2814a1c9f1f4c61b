"""A Hugging Face-style model mirror on 127.0.0.1, or a front for an S3 server, that misbehaves on demand.

As a mirror it answers what the Hub does for a model (https://huggingface.co/docs/hub/api): ``GET
/api/models/{org}/{repo}/revision/{revision}`` with ``siblings`` (``rfilename``, ``size``, ``blobId`` and, for large
files, ``lfs: {sha256, size}``), and ``GET|HEAD /{org}/{repo}/resolve/{revision}/{file}`` with ranges, the LFS
file's SHA-256 as its ETag and ``X-Linked-Etag`` as the Hub sends them; with ``cdn``, an LFS file's resolve is
answered as the Hub does, a 302 to its CDN (``Location``, with ``X-Linked-Size`` and ``X-Linked-Etag``), here a
path of its own; with ``chunked``, bodies come chunked, without a ``Content-Length``. As a front it forwards every
request to ``upstream`` and streams the answer back. Either way each request is recorded (method, path, Range) and
the next ones for a path can fail: ``503`` (S3's SlowDown), ``500``, ``404``, ``drop`` (half the body, then the
connection closes), ``stall`` (half the body, then nothing), ``wrong`` (the right length, wrong bytes), ``hang`` (no
answer).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from simulate.fakes.ranges import Unsatisfiable, byte_range, content_range, write_chunks

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")
HOP_BY_HOP = {"host", "connection", "keep-alive", "transfer-encoding", "content-length"}


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    range: str | None


@dataclass
class FaultyServer:
    files: dict[str, bytes] = field(default_factory=dict)  # the mirror's repository, by path
    repo: str = "org/model"
    root: str = ""  # the path the mirror is served under ("/hub" for http://host/hub/org/model/resolve/...)
    revision: str = "main"
    upstream: str | None = None  # forward everything here instead of serving files
    chunk_delay_s: float = 0.0  # a pause after every 64 KiB of a body, to make a transfer last
    sizeless: set[str] = field(default_factory=set)  # paths listed by name alone (as without ?blobs=true)
    listed_only: set[str] = field(default_factory=set)  # paths in the model info that are not served
    # The status of a range's answer: 206, or 200 with the Content-Range all the same (rclone serve s3's), or None
    # for a server that ignores Range and sends the whole file with a 200.
    range_status: int | None = 206
    cdn: bool = False
    chunked: bool = False
    requests: list[Seen] = field(default_factory=list)
    _faults: list[tuple[str, str]] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)
    _digests: dict[str, tuple[bytes, str, str]] = field(default_factory=dict)  # path: (content, git sha1, sha256)

    def fail(self, kind: str, path: str, *, times: int = 1) -> None:
        """Answer the next ``times`` GETs whose path ends with ``path`` with the fault ``kind``."""
        self._faults.extend([(kind, path)] * times)

    def ranges(self, path: str) -> list[str | None]:
        return [seen.range for seen in self.requests if seen.method == "GET" and seen.path.endswith(path)]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        app.on_shutdown.append(self._shutdown)
        app.on_cleanup.append(self._close)
        return app

    async def _shutdown(self, _: web.Application) -> None:
        self._closing.set()  # hung answers end, so the server stops at once

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _fault(self, path: str) -> str | None:
        for index, (kind, suffix) in enumerate(self._faults):
            if path.endswith(suffix):
                del self._faults[index]
                return kind
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(Seen(request.method, request.path, request.headers.get("Range")))
        info = f"{self.root}/api/models/{self.repo}/revision/{self.revision}"
        if self.upstream is None and request.path == info:
            return web.json_response({"id": self.repo, "sha": "0" * 40, "siblings": self._siblings()})
        fault = self._fault(request.path) if request.method == "GET" else None
        if fault == "hang":
            await self._closing.wait()
            raise web.HTTPServiceUnavailable()
        if fault in ("503", "500", "404"):
            body = SLOW_DOWN if fault == "503" else b"injected fault"
            return web.Response(status=int(fault), body=body, headers={"Retry-After": "0"} if fault == "503" else {})
        if self.upstream is not None:
            return await self._forward(request, fault)
        prefix = f"{self.root}/{self.repo}/resolve/{self.revision}/"
        cdn = f"{self.root}/cdn/"
        path = request.path.removeprefix(prefix).removeprefix(cdn)
        if not request.path.startswith((prefix, cdn)) or path not in self.files or path in self.listed_only:
            return web.Response(status=404, text="Entry not found")
        if self.cdn and request.path.startswith(prefix) and path.endswith(LFS_SUFFIXES):
            _, sha256 = self._hashes(path, self.files[path])
            headers = {"X-Linked-Size": str(len(self.files[path])), "X-Linked-Etag": f'"{sha256}"'}
            location = f"{request.url.origin()}{cdn}{path}"
            return web.Response(status=302, headers={**headers, "Location": location})
        return await self._serve(request, self.files[path], path, fault)

    def _siblings(self) -> list[dict[str, object]]:
        siblings: list[dict[str, object]] = []
        for path, data in sorted(self.files.items()):
            if path in self.sizeless:
                siblings.append({"rfilename": path})
                continue
            blob, sha256 = self._hashes(path, data)
            sibling: dict[str, object] = {"rfilename": path, "size": len(data), "blobId": blob}
            if path.endswith(LFS_SUFFIXES):
                sibling["lfs"] = {"sha256": sha256, "size": len(data), "pointerSize": 134}
            siblings.append(sibling)
        return siblings

    def _hashes(self, path: str, data: bytes) -> tuple[str, str]:
        """The git blob id and SHA-256 of a file, computed once for each content it is given."""
        known = self._digests.get(path)
        if known is None or known[0] is not data:
            known = self._digests[path] = (data, _git_sha1(data), hashlib.sha256(data).hexdigest())
        return known[1], known[2]

    async def _serve(self, request: web.Request, data: bytes, path: str, fault: str | None) -> web.StreamResponse:
        blob, sha256 = self._hashes(path, data)
        headers = {"Accept-Ranges": "bytes", "ETag": f'"{blob}"'}
        if path.endswith(LFS_SUFFIXES):
            headers["ETag"] = headers["X-Linked-Etag"] = f'"{sha256}"'
        status, body = 200, data
        try:
            wanted = byte_range(request.headers.get("Range"), len(data)) if self.range_status is not None else None
        except Unsatisfiable:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}"})
        if wanted is not None and self.range_status is not None:
            first, last = wanted
            status, body = self.range_status, data[first : last + 1]
            headers["Content-Range"] = content_range(first, last, len(data))
        response = web.StreamResponse(status=status, headers=headers)
        if self.chunked:
            response.enable_chunked_encoding()
        else:
            response.content_length = len(body)
        await response.prepare(request)
        if request.method == "GET":
            await self._body(request, response, body, fault)
        return response

    async def _forward(self, request: web.Request, fault: str | None) -> web.StreamResponse:
        assert self.upstream is not None
        if self._session is None:
            self._session = aiohttp.ClientSession(auto_decompress=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=await request.read()
        ) as answer:
            body = await answer.read()
            kept = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP}
            length = answer.headers.get("Content-Length", "0") if request.method == "HEAD" else str(len(body))
            response = web.StreamResponse(status=answer.status, headers={**kept, "Content-Length": length})
            await response.prepare(request)
            if request.method != "HEAD":
                await self._body(request, response, body, fault if answer.status < 300 else None)
            return response

    async def _body(self, request: web.Request, response: web.StreamResponse, body: bytes, fault: str | None) -> None:
        if fault == "wrong":
            body = bytes(b ^ 0xFF for b in body[:16]) + body[16:]
        if fault in ("drop", "stall"):
            await response.write(body[: len(body) // 2])
            if fault == "stall":
                await self._closing.wait()
            assert request.transport is not None
            request.transport.close()
            return
        await write_chunks(response, body, after_chunk=self._pause if self.chunk_delay_s else None)

    async def _pause(self, _: int) -> None:
        await asyncio.sleep(self.chunk_delay_s)


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
