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
    """An HTTP API answered with an error status, or did not answer (``status`` 0), or answered what cannot be read.

    ``timeout`` (no whole answer in time) and ``malformed`` (a body that is not the JSON asked for, whatever its
    status) are transport failures: as transient as a lost connection.
    """

    def __init__(
        self, status: int, message: str, *, retry_after_s: float | None = None, failure: str | None = None
    ) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.failure = failure  # "timeout" or "malformed", else None

    @property
    def transient(self) -> bool:
        """Worth retrying: no answer, conflicts, throttling (including PodDisruptionBudget 429s) and 5xx."""
        return self.failure is not None or self.status in (0, 409, 429) or self.status >= 500

    @property
    def kind(self) -> str:
        """A bounded label for counting: ``timeout``, ``malformed``, ``unreachable``, ``conflict``, ``throttled``,
        ``server``, ``client``."""
        if self.failure is not None:
            return self.failure
        if self.status == 0:
            return "unreachable"
        if self.status == 409:
            return "conflict"
        if self.status == 429:
            return "throttled"
        return "server" if self.status >= 500 else "client"


def as_api_error(error: Exception) -> ApiError:
    """Any failure of a call as an ApiError: an exception of another class is a transient failure with no status."""
    return error if isinstance(error, ApiError) else ApiError(0, f"{type(error).__name__}: {error}")


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
    left_s: Callable[[], float] | None = None,
    retry_if: Callable[[ApiError], bool] = lambda error: error.transient,
) -> T:
    """Call until it succeeds; errors ``retry_if`` accepts (the transient ones) wait out the backoff (or
    Retry-After), others raise at once.

    With ``forever`` the last backoff step repeats, for calls that must eventually happen; otherwise the last
    transient error is raised once the backoff is used up. ``left_s`` bounds the retries by a deadline: the last
    error is raised rather than waited on past it. Each call of ``retrying`` starts its own schedule.
    """
    delays = itertools.chain(backoff_s, itertools.repeat(list(backoff_s)[-1])) if forever else iter(backoff_s)
    while True:
        try:
            return await call()
        except ApiError as error:
            on_error(error)
            delay = next(delays, None)
            if not retry_if(error) or delay is None:
                raise
            delay = error.retry_after_s if error.retry_after_s is not None else delay
            if left_s is not None and left_s() <= delay:
                raise
            log.warning("api.retry", what=what, error=str(error), kind=error.kind, retry_in_s=delay)
            await asyncio.sleep(delay)
