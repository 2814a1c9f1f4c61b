"""The backends: which are ready, how many streams each holds, and the health checker that keeps that true."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Collection, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import structlog

from gateway.keepalive import Kept
from gateway.metrics import GatewayMetrics
from spotdrain import http1
from spotdrain.clock import rfc3339

log = structlog.get_logger()

# A backend that failed this way is taken out of rotation until its health check passes again; a 5xx, an error
# event or an abort says the request failed, not that the backend is gone, and so does a reset: behind one URL (a
# Service) another pod may answer the continuation, and a backend that is really gone refuses the next connection.
GONE_CAUSES = frozenset({"unavailable", "timeout", "stalled"})


@dataclass
class Backend:
    url: str
    ready_url: str  # its 200 puts the backend in rotation
    ready: bool = True
    open_streams: int = 0
    picked: int = 0  # when it was last picked, to spread ties
    token_ids: bool = True  # takes ``return_token_ids`` (False once it refused the field)
    context_len: int | None = None  # its model's context (``max_model_len``), once asked
    # A stall probe found it refusing new connections, or one of its streams ended with an error event or an abort:
    # its stalled streams move at once (gateway.stalls), until one of its streams ends whole.
    failing: bool = False
    refused: bool = False  # ...and it was the probe: its streams stall at half a second's silence, until it connects
    kept: Kept = field(default_factory=Kept, compare=False)  # its connections idle between streams


class Closable(Protocol):
    def close(self) -> None: ...


class Mover:
    """One stream's hold on its backend's response, so the gateway can move the stream elsewhere: before the node
    goes (cause ``proactive``), when it stalls on a backend that is going away (``stalled``), or when the backend
    has been silent for the read timeout (``timeout``)."""

    __slots__ = (
        "_folded",
        "_gap_s",
        "_loop",
        "_response",
        "_timer",
        "cause",
        "heard_at",
        "moved",
        "reads",
        "silence_s",
    )

    def __init__(self, *, silence_s: float | None = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.moved = False
        self.cause = "proactive"
        self.heard_at: float | None = None  # monotonic time of the backend's last bytes (None: no response yet)
        self.reads = 0  # of the backend's bytes
        self._gap_s: float | None = None  # the backend's usual gap between reads, a moving average...
        self._folded = (0, 0.0)  # ...of the reads up to the first, heard at the second
        self.silence_s = silence_s  # the read timeout; None: none
        self._response: Closable | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop = loop  # the running one, where the caller has it (asking makes a getpid system call)

    def attach(self, response: Closable | None) -> None:
        self._response = response
        self.heard_at = None if response is None else time.monotonic()
        self._folded = (self.reads, self.heard_at or 0.0)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if response is not None and self.moved:
            response.close()
        elif response is not None and self.silence_s is not None:
            self._loop = self._loop or asyncio.get_running_loop()
            self._timer = self._loop.call_later(self.silence_s, self._check_silence)

    def heard(self, now: float) -> None:
        """The backend sent bytes at ``now``."""
        self.heard_at = now
        self.reads += 1

    def usual_gap(self) -> float | None:
        """The backend's usual gap between reads (None: too few reads to tell): a moving average, each read weighing
        an eighth, of the mean gap over the reads since the last call, so that a read costs two stores, not this."""
        reads, since = self._folded
        if self.heard_at is None or self.reads == reads:
            return self._gap_s
        count = self.reads - reads
        gap = min((self.heard_at - since) / count, GAP_SAMPLE_MAX_S)
        self._gap_s = gap if self._gap_s is None else gap + (self._gap_s - gap) * (7 / 8) ** count
        self._folded = (self.reads, self.heard_at)
        return self._gap_s

    def move(self, cause: str = "proactive") -> None:
        """End the backend's answer now; the stream continues elsewhere with ``cause``."""
        if not self.moved:
            self.moved = True
            self.cause = cause
            if self._response is not None:
                self._response.close()

    def _check_silence(self) -> None:
        """The read timeout, as one timer per stream moved on to the last bytes heard when it fires: a timer per read
        (what aiohttp's ``sock_read`` does) costs a cancel and a new timer for every chunk relayed."""
        self._timer = None
        if self._response is None or self.heard_at is None or self.silence_s is None:
            return
        left = self.heard_at + self.silence_s - time.monotonic()
        if left <= 0:
            self.move("timeout")
        else:
            assert self._loop is not None  # kept by attach, which made the first of these timers
            self._timer = self._loop.call_later(left, self._check_silence)


# A prefill can hold a stream's second read back a while: one slow read must not make the usual gap long.
GAP_SAMPLE_MAX_S = 2.0


class Held:
    """``Pool.hold``'s context: ``mover`` among its backend's streams while it lasts (a class of its own, not a
    generator's context, as every stream enters one)."""

    __slots__ = ("mover", "movers", "streaming")

    def __init__(self, movers: set[Mover], mover: Mover, streaming: asyncio.Event) -> None:
        self.movers = movers
        self.mover = mover
        self.streaming = streaming

    def __enter__(self) -> None:
        self.movers.add(self.mover)
        self.streaming.set()

    def __exit__(self, *_: object) -> None:
        self.movers.discard(self.mover)


class Pool:
    def __init__(self, urls: Sequence[str], metrics: GatewayMetrics, *, ready_urls: Sequence[str] = ()) -> None:
        ready_urls = ready_urls or [f"{url}/health" for url in urls]
        self.backends = [Backend(url, ready) for url, ready in zip(urls, ready_urls, strict=True)]
        self.metrics = metrics
        self.holding: dict[str, set[Mover]] = {}  # backend URL -> the streams it is relaying
        self.streaming = asyncio.Event()  # set as a stream starts relaying; cleared by whoever waits for the next
        self.leaving: dict[str, datetime] = {}  # backend URL -> its node's termination time
        self.leaving_changed = asyncio.Event()
        self.recheck = asyncio.Event()  # a broken stream found no backend it has not tried: check readiness now
        self._readied = asyncio.Event()  # set (and replaced) each time a backend turns ready
        self._picks = itertools.count(1)
        self._publish()

    def pick(self, *, avoid: Collection[str] = ()) -> Backend | None:
        """The ready backend with the fewest open streams, preferring those not in ``avoid``; None if none is ready.

        A backend in ``avoid`` (it already failed this request) is still chosen when it is the only ready one: a
        dropped connection does not always mean the backend is gone.
        """
        ready = [b for b in self.backends if b.ready and b.url not in self.leaving]
        fresh = [b for b in ready if b.url not in avoid] or ready
        if not fresh:
            return None
        chosen = min(fresh, key=lambda b: (b.open_streams, b.picked))
        chosen.picked = next(self._picks)
        return chosen

    async def fresh(self, avoid: Collection[str], *, within_s: float) -> bool:
        """Whether a backend not in ``avoid`` is ready within ``within_s``; readiness is checked again now rather
        than at the next interval (the spare of a stopping server may have turned ready since)."""
        self.recheck.set()
        with suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while not any(b.ready and b.url not in avoid and b.url not in self.leaving for b in self.backends):
                    await self._readied.wait()
                return True
        return False

    def _became_ready(self) -> None:
        self._readied.set()
        self._readied = asyncio.Event()

    def follow(self, urls: Sequence[str]) -> None:
        """Backends are now ``urls`` (a Service's ready endpoints); those kept keep their state and open streams."""
        known = {b.url: b for b in self.backends}
        if list(known) == list(urls):
            return
        self.backends = [known.get(url) or Backend(url, f"{url}/health") for url in urls]
        for gone in known.keys() - set(urls):
            known[gone].kept.close()
        log.info("backends.changed", backends=list(urls))
        self._publish()
        self._became_ready()

    def set_leaving(self, times: dict[str, datetime]) -> None:
        """Backends whose node has a termination time: they get no new stream, and theirs move before it."""
        if times != self.leaving:
            log.info("backends.leaving", backends={url: rfc3339(at) for url, at in sorted(times.items())})
            self.leaving = times
            self.leaving_changed.set()
            for backend in self.backends:
                if backend.url in times:
                    backend.kept.close()

    def hold(self, backend: Backend, mover: Mover) -> Held:
        """While a stream relays from ``backend`` (``with pool.hold(...)``): it can be moved off it."""
        return Held(self.holding.setdefault(backend.url, set()), mover, self.streaming)

    async def relaying(self) -> None:
        """Until a stream relays from a backend (at once where one does)."""
        self.streaming.clear()
        if not any(self.holding.values()):
            await self.streaming.wait()

    def due(self, now: datetime, *, margin_s: float) -> list[tuple[str, Mover]]:
        """Streams on backends whose node goes within ``margin_s``: to be moved now."""
        soon = now + timedelta(seconds=margin_s)
        return [
            (url, mover)
            for url, at in self.leaving.items()
            if at <= soon
            for mover in self.holding.get(url, ())
            if not mover.moved
        ]

    def failed(self, backend: Backend, cause: str) -> None:
        self.metrics.backend_errors.labels(kind=cause).inc()
        if cause in GONE_CAUSES and backend.ready:
            backend.ready = False
            backend.kept.close()
            log.warning("backend.unready", backend=backend.url, cause=cause)
            self._publish()

    def set_ready(self, backend: Backend, ready: bool, *, detail: str = "") -> None:
        """What a health check found; ``detail``: why it was not ready (logged where the backend leaves rotation)."""
        if backend.ready != ready:
            backend.ready = ready
            if ready:
                log.info("backend.ready", backend=backend.url, cause="health")
            else:
                backend.kept.close()
                log.info("backend.unready", backend=backend.url, cause="health", detail=detail)
            self._publish()
            if ready:
                self._became_ready()

    def going_away(self, url: str) -> bool:
        """Whether the backend at ``url`` is leaving: its node's termination time is set, it is out of rotation (its
        endpoint not ready or terminating, its ready URL failing) or gone from the Service, it refused a connection,
        or its engine ended a stream with an error event or an abort."""
        if url in self.leaving:
            return True
        backend = self.backend(url)
        return backend is None or not backend.ready or backend.failing

    def backend(self, url: str) -> Backend | None:
        """The backend at ``url``; None once it is gone from the Service."""
        return next((b for b in self.backends if b.url == url), None)

    def any_ready(self) -> bool:
        return any(b.ready for b in self.backends)

    def _publish(self) -> None:
        self.metrics.backends_ready.set(sum(b.ready for b in self.backends))


async def health_checker(pool: Pool, *, interval_s: float, timeout_s: float) -> None:
    """Asks every backend's ready URL each interval; a 200 makes it ready, anything else not (a redirect too, a
    hung or cut answer, one that is not HTTP). Runs until cancelled.

    The engine's ``/health`` stays 200 while its pod drains; a sidecar's ``/ready`` turns 503 at the drain's start,
    which is why ``--ready-url`` exists: a draining pod then gets no new request, as a Service would do. Each check
    is one connection of its own, closed once the answer's head is read: one kept open to the engine's port would
    look, to the pod's sidecar, like a client still there. A stream that broke asks for a check at once
    (``Pool.fresh``), so checks come with every break: each is made as the relay makes its requests
    (spotdrain/http1.py), at half an aiohttp request's CPU.
    """
    while True:
        pool.recheck.clear()
        await asyncio.gather(*(check_ready(pool, b, timeout_s=timeout_s) for b in pool.backends))
        with suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await pool.recheck.wait()


async def check_ready(pool: Pool, backend: Backend, *, timeout_s: float) -> None:
    """One look at ``backend``'s ready URL, all of it within ``timeout_s``."""
    query = urlsplit(backend.ready_url).query
    answer: http1.Answer | None = None
    try:
        async with asyncio.timeout(timeout_s):
            answer = await http1.connect(backend.ready_url, connect_s=timeout_s)
            await answer.send(f"?{query}" if query else "", b"", {}, method="GET")
        detail = "" if answer.status == 200 else f"HTTP {answer.status}"
    except TimeoutError:
        detail = f"no answer within {timeout_s} s"
    except (OSError, http1.BadAnswer, ValueError) as error:  # ValueError: a URL whose port is not one
        detail = str(error) or type(error).__name__
    finally:
        if answer is not None:
            answer.close()
    pool.set_ready(backend, not detail, detail=detail)


async def context_length(
    session: aiohttp.ClientSession, backend: Backend, *, model: object, timeout_s: float
) -> int | None:
    """The backend's ``max_model_len`` for ``model`` (vLLM's ``/v1/models``), asked once and kept; None if unknown."""
    if backend.context_len is not None:
        return backend.context_len
    try:
        async with session.get(backend.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
            cards = json.loads(await answer.read()).get("data") if answer.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, AttributeError):
        return None
    cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards else None)
    length = card.get("max_model_len") if card is not None else None
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        backend.context_len = length
    return backend.context_len
