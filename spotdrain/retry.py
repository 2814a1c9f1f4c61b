"""One retry helper for every API call: a finite backoff tuple, Retry-After honoured, errors sorted by kind."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

import structlog

log = structlog.get_logger()
T = TypeVar("T")

BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class ApiError(Exception):
    """An HTTP API answered with an error status (or did not answer: ``status`` 0)."""

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.retry_after_s = retry_after_s

    @property
    def transient(self) -> bool:
        """Worth retrying: no answer, conflicts, throttling (including PodDisruptionBudget 429s) and 5xx."""
        return self.status in (0, 409, 429) or self.status >= 500

    @property
    def kind(self) -> str:
        """A bounded label for counting: ``unreachable``, ``conflict``, ``throttled``, ``server``, ``client``."""
        if self.status == 0:
            return "unreachable"
        if self.status == 409:
            return "conflict"
        if self.status == 429:
            return "throttled"
        return "server" if self.status >= 500 else "client"


def api_message(body: str) -> str:
    """The ``message`` of a Kubernetes ``Status`` body, or the start of whatever else came back."""
    try:
        return str(json.loads(body).get("message") or body)[:300]
    except (ValueError, AttributeError):
        return body[:300]


def retry_after(header: str | None) -> float | None:
    """Seconds from a Retry-After header given in seconds; dates and garbage are ignored."""
    try:
        return max(0.0, float(header)) if header is not None else None
    except ValueError:
        return None


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    what: str,
    backoff_s: Iterable[float] = BACKOFF_S,
    forever: bool = False,
    on_error: Callable[[ApiError], None] = lambda _: None,
) -> T:
    """Call until it succeeds; transient errors wait out the backoff (or Retry-After), others raise at once.

    With ``forever`` the last backoff step repeats, for calls that must eventually happen; otherwise the last
    transient error is raised once the backoff is used up.
    """
    delays = itertools.chain(backoff_s, itertools.repeat(list(backoff_s)[-1])) if forever else iter(backoff_s)
    while True:
        try:
            return await call()
        except ApiError as error:
            on_error(error)
            delay = next(delays, None)
            if not error.transient or delay is None:
                raise
            delay = error.retry_after_s if error.retry_after_s is not None else delay
            log.warning("api.retry", what=what, error=str(error), kind=error.kind, retry_in_s=delay)
            await asyncio.sleep(delay)
