"""A Kubernetes API server on 127.0.0.1 for the tests and ``spotdrain simulate``, reached as a real cluster is.

HTTPS with its own CA and a bearer token; clients connect through ``write_kubeconfig`` or ``serviceaccount_dir``.
It serves nodes, pods (with ``/status`` and ``/eviction``), core and events.k8s.io events and policy/v1
PodDisruptionBudgets (and namespaces, Services, DaemonSets and Deployments, as plain objects): get, list with label and
field selectors, watch (``simulate.fakes.kube_watch``), create, replace,
the three patch types, a pod's proxy (``/pods/{name}:{port}/proxy/...``, to 127.0.0.1 only), and graceful pod
deletion that it finishes after the grace period, as a kubelet would. Tests
steer it with ``latency_s``, ``fail_next``, ``on_delete``, ``faults`` (hung requests, dropped connections, answers
that are not JSON: see ``simulate.fakes.faults``), ``watches`` (``drop()``, ``silence()``) and ``compact()``, and
read what clients asked in ``calls``. ``token`` may do anything;
``issue_token`` makes tokens that may not do some things (403), and any other token is refused (401).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import structlog
from aiohttp import web

from simulate.fakes.faults import Faults
from simulate.fakes.kube_api import Api, DeleteHook, Deletion
from simulate.fakes.kube_auth import Accounts
from simulate.fakes.kube_cluster import Cluster
from simulate.fakes.kube_proxy import proxy
from simulate.fakes.kube_resources import REVIEWS, route
from simulate.fakes.kube_select import KubeError, bad_request, flag
from simulate.fakes.kube_store import Store
from simulate.fakes.kube_watch import BOOKMARK_EVERY_S, Watches
from simulate.fakes.tls import TlsFiles, server_ssl_context, write_tls_files
from spotdrain.clock import utcnow

log = structlog.get_logger()

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    pattern: str  # the path with placeholders: /api/v1/namespaces/{namespace}/pods/{name}/eviction
    query: Mapping[str, str]


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    remaining: int
    retry_after_s: float | None
    message: str


class FakeKube(Cluster):
    """The API server and its state. Use ``async with FakeKube() as kube:`` or ``start()`` / ``stop()``."""

    def __init__(
        self,
        *,
        token: str | None = None,
        latency_s: float = 0.0,
        port: int = 0,
        tls_dir: Path | None = None,
        now: Callable[[], datetime] = utcnow,
        bookmark_every_s: float = BOOKMARK_EVERY_S,
    ) -> None:
        self.token = token or secrets.token_urlsafe(32)
        self.accounts = Accounts(self.token)
        self.latency_s = latency_s  # added to every call
        self.store = Store(now=now)
        self.api = Api(self.store, now=now)
        self.watches = Watches(self.store, show=self.api.shown, bookmark_every_s=bookmark_every_s)
        self.calls: list[Call] = []
        self._now = now
        self._port = port
        self._tls_dir = tls_dir
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        self._tls: TlsFiles | None = None
        self._runner: web.AppRunner | None = None
        self._faults: list[_Fault] = []
        self.faults = Faults()

    # Lifecycle and client configuration ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Write the TLS files and listen on 127.0.0.1; returns once the server accepts connections."""
        directory = self._tls_dir
        if directory is None:
            self._temp = tempfile.TemporaryDirectory(prefix="spotdrain-kube-")
            directory = Path(self._temp.name)
        self._tls = write_tls_files(directory)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.faults.wrap(self._handle))
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, ssl_context=server_ssl_context(self._tls))
        await site.start()
        self._port = self._runner.addresses[0][1]
        log.info("kube.listening", url=self.url)

    async def stop(self) -> None:
        """Stop serving, cancel pending pod removals and running deletion hooks, end hung requests."""
        self.faults.release()
        self.watches.close()
        await self.api.close()
        if self._runner is not None:
            await asyncio.shield(self._runner.cleanup())
        if self._temp is not None:
            self._temp.cleanup()

    async def __aenter__(self) -> FakeKube:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self._port}"

    @property
    def ca_path(self) -> Path:
        if self._tls is None:
            raise RuntimeError("the fake API server has not started")
        return self._tls.ca_path

    def write_kubeconfig(self, path: Path, *, namespace: str = "default", token: str | None = None) -> Path:
        """A kubeconfig (JSON, which YAML readers take) with the server, its CA file and ``token`` (default: one
        that may do anything)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url, "certificate-authority": str(self.ca_path)}}],
            "users": [{"name": "fake", "user": {"token": token or self.token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    def issue_token(self, user: str, *, denied: Iterable[tuple[str, str]] = ()) -> str:
        """A token for ``user`` (``system:serviceaccount:<namespace>:<name>``) that is refused with 403 each
        (verb, resource) of ``denied``, e.g. ``("patch", "pods/status")``: a Role without that rule."""
        return self.accounts.issue(user, denied=denied)

    def serviceaccount_dir(self, path: Path, *, namespace: str = "default", token: str | None = None) -> Path:
        """Write ``token`` (default: one that may do anything), ``ca.crt`` and ``namespace`` as a pod's service
        account mount holds them."""
        path.mkdir(parents=True, exist_ok=True)
        (path / "token").write_text(token or self.token)
        (path / "ca.crt").write_bytes(self.ca_path.read_bytes())
        (path / "namespace").write_text(namespace)
        return path

    def service_env(self) -> dict[str, str]:
        """The variables an in-cluster client reads to find the API server."""
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self._port)}

    # Steering --------------------------------------------------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        path_regex: str,
        status: int,
        count: int = 1,
        *,
        retry_after: float | None = None,
        message: str | None = None,
    ) -> None:
        """Answer the next ``count`` calls of ``method`` (``*`` for any) on a path matching ``path_regex``."""
        reason = _REASONS.get(status, "Unknown")
        text = message or f"injected failure: {reason}"
        self._faults.append(_Fault(method.upper(), re.compile(path_regex), status, count, retry_after, text))

    def on_delete(self, hook: DeleteHook) -> None:
        """Call ``hook(pod, grace_s)`` when a pod's deletion starts or its grace period shortens (0: removed)."""
        self.api.hooks.append(hook)

    def compact(self) -> None:
        """Forget the history of changes, as etcd compaction does: a watch from an older version is answered 410."""
        self.store.compact()

    def count(self, method: str, pattern: str) -> int:
        return sum(1 for c in self.calls if c.method == method and c.pattern == pattern)

    def counts(self) -> Counter[tuple[str, str]]:
        return Counter((c.method, c.pattern) for c in self.calls)

    @property
    def deletions(self) -> list[Deletion]:
        """Pod deletions begun (or shortened) through DELETE or eviction, in order."""
        return self.api.deletions

    # Serving ---------------------------------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        target = route(request.path)
        pattern = target.pattern if target else request.path
        self.calls.append(Call(request.method, request.path, pattern, dict(request.query)))
        try:
            account = self.accounts.authenticate(request.headers.get("Authorization", ""))
            self._inject_fault(request)
            if target is None:
                raise KubeError(404, "NotFound", "the server could not find the requested resource")
            self.accounts.authorize(account, request.method, target, request.query)
            if request.method == "GET" and target.name is None and flag(request.query, "watch"):
                return await self.watches.serve(request, target, request.query)
            if target.subresource == "proxy":
                return await proxy(request, target, self.store)
            body = await _body(request) if request.method in ("POST", "PUT", "PATCH", "DELETE") else None
            if target.resource in REVIEWS and request.method == "POST":
                return web.json_response(self.accounts.review(account, target, body), status=201)
            status, answer = self.api.serve(
                request.method, target, query=request.query, content_type=request.content_type, body=body
            )
        except KubeError as error:
            return _status_response(error)
        return web.json_response(answer, status=status)

    def _inject_fault(self, request: web.Request) -> None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.method in ("*", request.method) and fault.path.search(request.path):
                fault.remaining -= 1
                retry = {"retryAfterSeconds": round(fault.retry_after_s)} if fault.retry_after_s is not None else {}
                raise KubeError(fault.status, _REASONS.get(fault.status, "Unknown"), fault.message, details=retry)


def _status_response(error: KubeError) -> web.Response:
    headers = {}
    if "retryAfterSeconds" in error.details:
        headers["Retry-After"] = str(error.details["retryAfterSeconds"])
    return web.json_response(error.status(), status=error.code, headers=headers)


async def _body(request: web.Request) -> Any:
    text = await request.text()
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError as error:
        raise bad_request(f"the request body is not JSON: {error}") from error
