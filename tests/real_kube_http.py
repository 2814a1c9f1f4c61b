"""The I/O under ``tests.real_kube``: the administrator's synchronous client, and the recording proxy clients go
through (``tests.real_kubelet`` is the third part)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from aiohttp import web

from simulate.fakes.kube import Call
from simulate.fakes.kube_resources import route
from simulate.fakes.processes import free_port
from simulate.fakes.tls import server_ssl_context, write_tls_files
from tests.control_plane import ControlPlane

Obj = dict[str, Any]
TIMEOUT_S = 10.0
# What a test's service account may be granted (``Admin.service_account_token``): every resource the programs use.
GRANTABLE = {
    "": ("nodes", "pods", "pods/status", "pods/eviction", "events", "services"),
    "events.k8s.io": ("events",),
    "discovery.k8s.io": ("endpointslices",),
    "policy": ("poddisruptionbudgets",),
}
PLURALS = {
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "ServiceAccount": "serviceaccounts",
    "Namespace": "namespaces",
    "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
    "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
}
CLUSTER_SCOPED_APPLIED = (
    "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations",
    "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations",
)
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")
TEST_LABEL = "spotdrain.io/test-fixture"


class ApiError(Exception):
    def __init__(self, status: int, body: Obj) -> None:
        super().__init__(f"{status}: {body.get('message', body)}")
        self.status = status
        self.body = body


class Admin:
    """Synchronous requests as the cluster's administrator: seeding and reading, never recorded as a call."""

    def __init__(self, url: str, ca_path: Path, token: str) -> None:
        self.client = httpx.Client(
            base_url=url, verify=ssl.create_default_context(cafile=str(ca_path)), timeout=TIMEOUT_S,
            headers={"Authorization": f"Bearer {token}"},
        )  # fmt: skip

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, body: Obj | None = None, *, content_type: str | None = None) -> Obj:
        headers = {"Content-Type": content_type} if content_type else {}
        content = json.dumps(body).encode() if body is not None else None
        answer = self.client.request(method, path, content=content, headers=headers)
        parsed: Obj = answer.json() if answer.content else {}
        if answer.status_code >= 400:
            raise ApiError(answer.status_code, parsed)
        return parsed

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body, content_type="application/json")

    def replace(self, path: str, body: Obj) -> Obj:
        return self.request("PUT", path, body, content_type="application/json")

    def patch(self, path: str, body: Obj) -> Obj:
        return self.request("PATCH", path, body, content_type="application/merge-patch+json")

    def delete(self, path: str) -> Obj:
        return self.request("DELETE", path)

    def find(self, path: str) -> Obj | None:
        try:
            return self.request("GET", path)
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def items(self, path: str) -> list[Obj]:
        items: list[Obj] = self.request("GET", path)["items"]
        return items

    def wait_for(self, path: str, check: Callable[[Obj], bool], *, timeout_s: float = TIMEOUT_S) -> Obj:
        give_up = time.monotonic() + timeout_s
        while True:
            found = self.find(path)
            if found is not None and check(found):
                return found
            if time.monotonic() > give_up:
                raise TimeoutError(f"{path} did not become as expected within {timeout_s} s: {found}")
            time.sleep(0.05)

    def ensure_namespace(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            self.create("/api/v1/namespaces", {"metadata": {"name": name}})

    def wipe(self, namespaces: Iterable[str]) -> None:
        """Delete what tests make: pods at once (no kubelet would), budgets, events, slices, services, nodes, and
        the service accounts and roles of ``service_account_token``."""
        for namespace in namespaces:
            base = f"/api/v1/namespaces/{namespace}"
            self.delete(f"{base}/pods?gracePeriodSeconds=0")
            self.delete(f"/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets")
            self.delete(f"{base}/events")
            self.delete(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices")
            for service in self.items(f"{base}/services"):
                if service["metadata"]["name"] != "kubernetes":
                    self.delete(f"{base}/services/{service['metadata']['name']}")
            self.delete(f"{base}/serviceaccounts?labelSelector={TEST_LABEL}")
            for kind in ("roles", "rolebindings"):
                self.delete(
                    f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/{kind}?labelSelector={TEST_LABEL}"
                )
        self.delete("/api/v1/nodes")
        for path in CLUSTER_SCOPED_APPLIED:
            self.delete(f"{path}?labelSelector={TEST_LABEL}")

    def service_account_token(self, user: str, *, denied: frozenset[tuple[str, str]]) -> str:
        """A token of ``system:serviceaccount:<namespace>:<name>``, allowed every verb of ``GRANTABLE`` but
        ``denied`` through a ClusterRole of its own: RBAC only adds, so a denial is a verb left out."""
        namespace, name = user.removeprefix("system:serviceaccount:").split(":")
        labels = {TEST_LABEL: "true"}
        self.ensure_namespace(namespace)
        with contextlib.suppress(ApiError):
            self.create(
                f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": name, "labels": labels}}
            )
        role = f"test-{namespace}-{name}"
        rules = [
            {"apiGroups": [group], "resources": [resource], "verbs": [v for v in VERBS if (v, resource) not in denied]}
            for group, resources in GRANTABLE.items()
            for resource in resources
        ]
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        self.create(f"{rbac}/clusterroles", {"metadata": {"name": role, "labels": labels}, "rules": rules})
        subject = {"kind": "ServiceAccount", "name": name, "namespace": namespace}
        binding = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role}
        meta = {"name": role, "labels": labels}
        self.create(f"{rbac}/clusterrolebindings", {"metadata": meta, "roleRef": binding, "subjects": [subject]})
        return self.token_for(namespace, name)

    def apply_and_token(self, objects: Iterable[Obj], namespace: str, name: str, *, pod: Obj | None = None) -> str:
        for obj in objects:
            self.apply(obj)
        self.ensure_namespace(namespace)
        account = {"metadata": {"name": name, "labels": {TEST_LABEL: "true"}}}
        with contextlib.suppress(ApiError):
            self.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", account)
        return self.token_for(namespace, name, pod=pod)

    def apply(self, obj: Obj) -> Obj:
        """Create ``obj`` (RBAC, admission and namespaces: what the tests apply from manifests), labelled so that
        ``wipe`` deletes it; one already there is replaced."""
        group, _, version = obj["apiVersion"].rpartition("/")
        base = f"/apis/{group}/{version}" if group else f"/api/{version}"
        meta = obj["metadata"]
        if namespace := meta.get("namespace"):
            self.ensure_namespace(namespace)
            base += f"/namespaces/{namespace}"
        path = f"{base}/{PLURALS[obj['kind']]}"
        labelled = {**obj, "metadata": {**meta, "labels": {**meta.get("labels", {}), TEST_LABEL: "true"}}}
        if (found := self.find(f"{path}/{meta['name']}")) is None:
            return self.create(path, labelled)
        labelled["metadata"]["resourceVersion"] = found["metadata"]["resourceVersion"]
        return self.replace(f"{path}/{meta['name']}", labelled)

    def token_for(self, namespace: str, name: str, *, pod: Obj | None = None) -> str:
        """A TokenRequest for the service account, bound to ``pod`` when given (as a projected volume's is)."""
        spec: Obj = {"expirationSeconds": 3600}
        if pod is not None:
            spec["boundObjectRef"] = {"kind": "Pod", "apiVersion": "v1", "name": pod["metadata"]["name"],
                                      "uid": pod["metadata"]["uid"]}  # fmt: skip
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        token: str = self.create(path, {"spec": spec})["status"]["token"]
        return token


@dataclass
class _Fault:
    method: str
    path: re.Pattern[str]
    status: int
    remaining: int
    retry_after_s: float | None
    message: str


class RecordingProxy:
    """HTTPS on 127.0.0.1 forwarding to the API server, recording each request as ``FakeKube.calls`` does."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.calls: list[Call] = []
        self.open_watches = 0  # watches the API server has answered and not yet ended
        self.port = free_port()
        self._faults: list[_Fault] = []
        self._temp = tempfile.TemporaryDirectory(prefix="spotdrain-proxy-")
        self._tls = write_tls_files(Path(self._temp.name))
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_path(self) -> Path:
        return self._tls.ca_path

    async def start(self) -> None:
        context = ssl.create_default_context(cafile=str(self.plane.ca_path))
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=server_ssl_context(self._tls)).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await asyncio.shield(self._runner.cleanup())
        if self._session is not None:
            await self._session.close()
        self._temp.cleanup()

    def fail_next(
        self,
        method: str,
        path: re.Pattern[str],
        status: int,
        count: int,
        retry_after: float | None,
        message: str | None,
    ) -> None:
        text = message or f"injected failure: {status}"
        self._faults.append(_Fault(method.upper(), path, status, count, retry_after, text))

    def saw_eviction(self, namespace: str, name: str) -> bool:
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/eviction"
        return any(c.method == "POST" and c.path == path for c in self.calls)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        target = route(request.path)
        self.calls.append(Call(request.method, request.path, target.pattern if target else request.path,
                               dict(request.query)))  # fmt: skip
        if (fault := self._take_fault(request)) is not None:
            return _fault_response(fault)
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type", "Accept")}
        async with self._session.request(
            request.method,
            self.plane.url + request.path_qs,
            data=await request.read(),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=None, connect=TIMEOUT_S),
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            for name in ("Content-Type", "Retry-After"):
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            await response.prepare(request)
            watch = request.query.get("watch") in ("1", "true")
            self.open_watches += watch
            try:
                with contextlib.suppress(aiohttp.ClientError, ConnectionResetError):
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
            finally:
                self.open_watches -= watch
            return response

    def _take_fault(self, request: web.Request) -> _Fault | None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.method in ("*", request.method) and fault.path.search(request.path):
                fault.remaining -= 1
                return fault
        return None


def _fault_response(fault: _Fault) -> web.Response:
    reasons = {409: "Conflict", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}
    body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": fault.message,
                 "reason": reasons.get(fault.status, "Unknown"), "code": fault.status}  # fmt: skip
    headers = {}
    if fault.retry_after_s is not None:
        body["details"] = {"retryAfterSeconds": round(fault.retry_after_s)}
        headers["Retry-After"] = str(round(fault.retry_after_s))
    return web.json_response(body, status=fault.status, headers=headers)
