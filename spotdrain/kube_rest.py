"""In-cluster access to the Kubernetes API over aiohttp, for the sidecar (no Kubernetes model classes).

The node agent uses kubernetes-asyncio; the sidecar only ever patches its own pod's status, and runs in every
inference pod, so it does that with the HTTP stack it already has.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from spotdrain.retry import ApiError, api_message, retry_after
from spotdrain.settings import SettingsError

STRATEGIC_MERGE = "application/strategic-merge-patch+json"
SERVICEACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # where a pod's token is mounted


class Access(Protocol):
    """Where an API server is and how to authenticate to it: a pod's service account, or a kubeconfig's user."""

    @property
    def base_url(self) -> str: ...

    def ssl_context(self) -> ssl.SSLContext: ...

    def headers(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class InCluster:
    """Where the API server is and how to authenticate, as a pod sees it."""

    base_url: str
    token_path: Path
    ca_path: Path

    @classmethod
    def from_environment(cls, serviceaccount_dir: Path, env: Mapping[str, str] = os.environ) -> InCluster:
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise SettingsError("not in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are unset")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", serviceaccount_dir / "token", serviceaccount_dir / "ca.crt")

    def missing(self) -> list[str]:
        """The files a call needs that are not there: a container without the account's token mounted."""
        return [str(path) for path in (self.token_path, self.ca_path) if not path.is_file()]

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_path))

    def headers(self) -> dict[str, str]:
        # Projected service account tokens are rotated on disk: read the file on every call.
        return {"Authorization": f"Bearer {self.token_path.read_text().strip()}"}


async def patch(
    session: aiohttp.ClientSession,
    cluster: Access,
    path: str,
    body: Mapping[str, Any] | list[Any],
    *,
    content_type: str = STRATEGIC_MERGE,
    timeout_s: float = 5.0,
) -> dict[str, Any]:
    """PATCH ``path``; raises ApiError with the status, the API's message and any Retry-After."""
    return await call(session, cluster, "PATCH", path, body, content_type=content_type, timeout_s=timeout_s)


async def call(
    session: aiohttp.ClientSession,
    cluster: Access,
    method: str,
    path: str,
    body: Mapping[str, Any] | list[Any] | None = None,
    *,
    content_type: str = "application/json",
    timeout_s: float = 5.0,
) -> dict[str, Any]:
    """One API call (GET, POST, PUT, PATCH); the object answered, or ApiError with the status, the API's message
    and any Retry-After (status 0: no answer)."""
    try:
        async with session.request(
            method,
            cluster.base_url + path,
            data=None if body is None else json.dumps(body),
            headers={**cluster.headers(), **({"Content-Type": content_type} if body is not None else {})},
            ssl=cluster.ssl_context(),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            payload = await response.text()
            if response.status >= 400:
                raise ApiError(
                    response.status,
                    api_message(payload),
                    retry_after_s=retry_after(response.headers.get("Retry-After")),
                )
            try:
                result = json.loads(payload) if payload else {}
            except ValueError:
                result = None
            if not isinstance(result, dict):
                raise ApiError(response.status, f"not a JSON object: {payload[:100]!r}", failure="malformed")
            return result
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise ApiError(0, f"{type(error).__name__}: {error}") from error
