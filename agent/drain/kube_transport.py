"""How the node agent's Kubernetes API calls go over the wire: each whole call bounded by a timeout, and a connection
that went silent or dropped never used again.

kubernetes-asyncio sends every call through one aiohttp session (``ApiClient.rest_client.pool_manager``) with no
timeout of its own (``aiohttp.ClientTimeout()`` is unbounded), and its pool keeps connections open for reuse. A
connection that went silent (a dead NAT entry, an API server that accepted a request and never answered) looks healthy
to the pool until a request on it hangs, and the connections opened beside it may be as dead. So after a call ended
without an answer, the ApiClient gets a new session: the retry, and every call after it, opens a new connection. The
old session is closed once the calls still running on it have had their timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog
from kubernetes_asyncio.client import ApiClient, rest
from kubernetes_asyncio.client.exceptions import ApiException

from spotdrain.retry import ApiError, retry_after

log = structlog.get_logger()

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Answer:
    status: int
    retry_after_s: float | None
    body: bytes


class Transport:
    """Sends calls made with ``_preload_content=False`` and reads their whole answer within ``timeout_s``."""

    def __init__(self, api: ApiClient, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.api = api
        self.timeout_s = timeout_s
        self._generation = 0  # bumped with each new session: a failure on an older one asks for nothing
        self._retiring: set[asyncio.Task[None]] = set()

    async def send(self, make: Callable[[], Awaitable[Any]]) -> Answer:
        """One call's status, Retry-After and body. Raises ApiError: status 0 when no whole answer came back
        (``timeout``, or unreachable: refused, reset, dropped mid-answer), else the status kubernetes-asyncio saw."""
        generation = self._generation
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await make()
                async with response:
                    body = await response.read()
                    return Answer(response.status, retry_after(response.headers.get("Retry-After")), body)
        except ApiException as error:
            headers: Any = error.headers or {}
            status = int(error.status or 0)
            raise ApiError(status, str(error.reason), retry_after_s=retry_after(headers.get("Retry-After"))) from None
        except TimeoutError:
            self._renew(generation, reason="timeout")
            raise ApiError(0, f"no answer within {self.timeout_s:g} s", failure="timeout") from None
        except (aiohttp.ClientError, OSError) as error:
            self._renew(generation, reason=type(error).__name__)
            raise ApiError(0, f"{type(error).__name__}: {error}") from None

    def _renew(self, generation: int, *, reason: str) -> None:
        if generation != self._generation:
            return
        self._generation += 1
        old = self.api.rest_client
        self.api.rest_client = rest.RESTClientObject(self.api.configuration)
        task = asyncio.get_running_loop().create_task(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        log.info("api.reconnecting", reason=reason)

    async def _retire(self, old: rest.RESTClientObject) -> None:
        try:
            await asyncio.sleep(self.timeout_s + 1)  # by then every call sent on it has ended
        finally:
            await asyncio.shield(old.close())

    async def close(self) -> None:
        """Close the sessions given up on; the ApiClient closes the one in use."""
        for task in list(self._retiring):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._retiring, return_exceptions=True)
