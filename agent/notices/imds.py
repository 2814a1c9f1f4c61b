"""The IMDS notice source: polls the instance metadata service and yields each interruption notice once.

IMDSv2 throughout: a session token from ``PUT /latest/api/token``, renewed before it expires and after a 401. IMDSv1
(no token) only where allowed and only when no token can be had. Failures are counted by kind and backed off; they
never end the stream of notices. A notice whose action failed before its deadline is handed back through its
acknowledgement and yielded again by the next poll that still shows it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from datetime import datetime, timedelta

import aiohttp
import structlog

from agent.notices.imds_parse import (
    ASG_BUDGET,
    INSTANCE_ID,
    LIFECYCLE,
    NOTICE_PATHS,
    TOKEN,
    ImdsFormatError,
    parse,
    parse_instance_id,
    parse_token,
)
from agent.notices.notice import Notice
from spotdrain.clock import rfc3339, utcnow
from spotdrain.metrics import CollectorRegistry, Counter, zeroed

log = structlog.get_logger()

DEFAULT_URL = "http://169.254.169.254"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
# bad_token: the token request was answered 200 with something that is not a token (a captive proxy, a misrouted
# hop). Unlike a malformed notice document it stops every read, so it is backed off like an outage.
ERROR_KINDS = ("timeout", "unreachable", "server", "throttled", "unauthorized", "malformed", "bad_token")
REFRESH_AT = 0.8  # of the token's TTL: renew well before IMDS starts answering 401
MAX_BACKOFF_S = 5.0


class ImdsMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter("spotdrain_imds_errors", "Failed IMDS requests, by kind", ["kind"], registry=registry)
        zeroed(self.errors, "kind", ERROR_KINDS)
        self.polls = Counter("spotdrain_imds_polls", "Rounds of polling IMDS for notices", registry=registry)


class ImdsError(Exception):
    """IMDS did not answer, or answered with an error status; ``kind`` is one of ``ERROR_KINDS``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def status_kind(status: int) -> str | None:
    """The error kind of an HTTP status, None for the answers a parser reads (200, 404 and the unexpected)."""
    if status in (401, 403):
        return "unauthorized"
    if status == 429:
        return "throttled"
    return "server" if status >= 500 else None


class ImdsClient:
    """GETs metadata paths with a session token, or without one where IMDSv1 is allowed and tokens fail."""

    def __init__(
        self, *, session: aiohttp.ClientSession, base_url: str, token_ttl_s: int, allow_v1: bool, timeout_s: float
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.token_ttl_s = token_ttl_s
        self.allow_v1 = allow_v1
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._token: str | None = None
        self._renew_at = 0.0
        self._v1 = False
        self._lock = asyncio.Lock()  # concurrent polls share one token request

    async def get(self, path: str) -> tuple[int, bytes]:
        """One answer for ``path``; a 401 gets one more try with a new token. Raises ImdsError."""
        token = await self.token()
        status, body = await self._send("GET", path, self._auth(token))
        if status == 401:
            self._forget(token)
            status, body = await self._send("GET", path, self._auth(await self.token()))
        kind = status_kind(status)
        if kind is not None:
            raise ImdsError(kind, f"GET {path} answered HTTP {status}")
        return status, body

    async def token(self) -> str | None:
        """A token that is not close to expiring; None in IMDSv1 mode."""
        async with self._lock:
            loop = asyncio.get_running_loop()
            if self._v1 or (self._token is not None and loop.time() < self._renew_at):
                return self._token
            try:
                self._token = await self._new_token()
            except ImdsError as error:
                if not self.allow_v1:
                    raise
                log.warning("imds.v1_fallback", error=str(error))
                self._v1, self._token = True, None
            else:
                self._renew_at = loop.time() + REFRESH_AT * self.token_ttl_s
            return self._token

    async def _new_token(self) -> str:
        status, body = await self._send("PUT", TOKEN, {TTL_HEADER: str(self.token_ttl_s)})
        if status != 200:
            raise ImdsError(status_kind(status) or "malformed", f"PUT {TOKEN} answered HTTP {status}")
        try:
            return parse_token(body)
        except ImdsFormatError as error:
            raise ImdsError("bad_token", str(error)) from None

    def _forget(self, token: str | None) -> None:
        """The token was refused: the next request asks for a new one (in IMDSv1 mode, tries tokens again)."""
        if token == self._token:
            self._token, self._v1 = None, False

    @staticmethod
    def _auth(token: str | None) -> dict[str, str]:
        return {} if token is None else {TOKEN_HEADER: token}

    async def _send(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            async with self.session.request(
                method, self.base_url + path, headers=headers, timeout=self.timeout, allow_redirects=False
            ) as response:
                return response.status, await response.read()
        except TimeoutError:
            raise ImdsError("timeout", f"{method} {path} timed out") from None
        except aiohttp.ClientError as error:
            raise ImdsError("unreachable", f"{method} {path}: {type(error).__name__}: {error}") from None


class ImdsSource:
    """Interruption notices from IMDS: spot instance-action, rebalance, scheduled maintenance, ASG lifecycle."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        base_url: str = DEFAULT_URL,
        interval_s: float = 1.0,
        token_ttl_s: int = 21600,
        allow_v1: bool = False,
        instance_id: str | None = None,
        metrics: ImdsMetrics | None = None,
        request_timeout_s: float = 1.0,
        max_backoff_s: float = MAX_BACKOFF_S,
        asg_budget: timedelta = ASG_BUDGET,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.client = ImdsClient(
            session=session, base_url=base_url, token_ttl_s=token_ttl_s, allow_v1=allow_v1, timeout_s=request_timeout_s
        )
        self.interval_s = interval_s
        self.instance_id = instance_id
        self.metrics = metrics or ImdsMetrics(CollectorRegistry())
        self.max_backoff_s = max_backoff_s
        self.asg_budget = asg_budget
        self.clock = clock
        self._failing: str | None = None  # the error kind last logged, None while IMDS answers
        self.last_round: datetime | None = None  # when the last round of requests ended, answered or not
        self._streak = 0  # rounds in a row that failed
        self._lifecycle_seen: dict[bytes, datetime] = {}
        self._seen: set[tuple[str, bool]] = set()  # notices yielded and not handed back

    async def notices(self) -> AsyncIterator[Notice]:
        """Poll every ``interval_s`` (longer while IMDS fails) and yield each notice the first time it is seen (or
        again once handed back), and a withdrawn one once more. Runs until the consumer stops; IMDS failures never
        end it."""
        instance_id = self.instance_id = self.instance_id or await self.discover()
        while True:
            for notice in await self.poll(instance_id):
                key = (notice.id, notice.withdrawn)
                if key not in self._seen:
                    self._seen.add(key)
                    self._announce(notice)
                    yield replace(notice, ack=_HandBack(self, notice, key))
            await asyncio.sleep(self._pause())

    def hand_back(self, notice: Notice, key: tuple[str, bool], reason: str) -> None:
        """Yield ``notice`` again on the next poll that shows it, unless its deadline has passed."""
        if self.clock() >= notice.deadline:
            return
        self._seen.discard(key)
        log.info("imds.notice_handed_back", notice=notice.id, reason=reason)

    async def discover(self) -> str:
        """Ask IMDS for this instance's id until it tells; returns it."""
        while True:
            try:
                status, body = await self.client.get(INSTANCE_ID)
                instance_id = parse_instance_id(status, body)
            except (ImdsError, ImdsFormatError) as error:
                self._round([self._failed(INSTANCE_ID, error)])
                await asyncio.sleep(self._pause())
            else:
                self._round([])
                log.info("imds.instance", instance=instance_id)
                return instance_id

    async def poll(self, instance_id: str) -> list[Notice]:
        """One round: every notice path at once, so one slow path costs one timeout, not four."""
        results = await asyncio.gather(*(self._read(path, instance_id) for path in NOTICE_PATHS))
        self.metrics.polls.inc()
        self._round([kind for _, kind in results if kind is not None])
        return [notice for notices, _ in results for notice in notices]

    async def _read(self, path: str, instance_id: str) -> tuple[list[Notice], str | None]:
        try:
            status, body = await self.client.get(path)
            now = self.clock()
            if path == LIFECYCLE:
                # Terminated is due a budget after it was first seen: later polls must not move the deadline (or id).
                now = self._lifecycle_seen.setdefault(body, now)
            return parse(path, status, body, now, instance_id=instance_id, budget=self.asg_budget), None
        except (ImdsError, ImdsFormatError) as error:
            return [], self._failed(path, error)

    def _failed(self, path: str, error: ImdsError | ImdsFormatError) -> str:
        kind = error.kind if isinstance(error, ImdsError) else "malformed"
        self.metrics.errors.labels(kind=kind).inc()
        if kind != self._failing:
            log.warning("imds.failing", kind=kind, path=path, error=str(error))
        self._failing = kind
        return kind

    def status(self) -> dict[str, str | None]:
        """What ``spotdrain check --node`` shows of this source: when it last asked IMDS, and what fails if anything."""
        last = None if self.last_round is None else rfc3339(self.last_round)
        return {
            "url": self.client.base_url,
            "instance_id": self.instance_id,
            "last_poll": last,
            "failing": self._failing,
        }

    def _round(self, kinds: list[str]) -> None:
        """Remember how the round went: the streak drives the backoff, a change of kind is logged once."""
        self.last_round = self.clock()
        if not kinds and self._failing is not None:
            log.info("imds.recovered", after=self._failing)
            self._failing = None
        # A malformed answer is no reason to poll less often: IMDS itself is fine.
        self._streak = self._streak + 1 if any(kind != "malformed" for kind in kinds) else 0

    def _pause(self) -> float:
        if not self._streak:
            return self.interval_s
        return min(self.max_backoff_s, max(self.interval_s, 0.05) * 2.0 ** min(self._streak, 16))

    def _announce(self, notice: Notice) -> None:
        log.info("imds.notice", **notice.logged(), detail=notice.detail, withdrawn=notice.withdrawn)


class _HandBack:
    """An IMDS notice's acknowledgement (``agent.notices.notice.Acknowledgement``): IMDS keeps no state to update, so
    only a retry does anything, handing the notice back to the source that yielded it."""

    def __init__(self, source: ImdsSource, notice: Notice, key: tuple[str, bool]) -> None:
        self._source, self._notice, self._key = source, notice, key

    async def succeeded(self) -> None:
        pass

    async def retry(self, reason: str) -> None:
        self._source.hand_back(self._notice, self._key, reason)

    async def drop(self, reason: str) -> None:
        pass

    async def heartbeat(self) -> None:
        pass
