"""Looking at the engine: its health over HTTP, and one reading of its metrics page and of the connections that
may still carry a request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import aiohttp
import structlog

from sidecar.connections import EngineConnections, Look, Patience, holding
from sidecar.engines import MetricsError, read_engine
from sidecar.metrics import SidecarMetrics
from sidecar.settings import EngineSettings
from sidecar.sockdiag import TcpConn
from sidecar.state import Reading

log = structlog.get_logger()

# Ask for the classic text format: OpenMetrics would also parse, but this is what every engine serves by default.
ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"


def engine_session() -> aiohttp.ClientSession:
    """A session that closes each connection after its request: a kept-alive scrape connection of our own
    would look like a client still holding a stream open."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


class EngineClient:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        settings: EngineSettings,
        metrics: SidecarMetrics,
        *,
        answered_s: float | None = None,
        timeout_s: float = 2.0,
        connections: Callable[[int], list[TcpConn] | None] | None = None,
    ) -> None:
        """``answered_s``: how long after its last bytes out a connection may still be inside a response (the
        confirmation window; default the engine's)."""
        self.session = session
        self.settings = settings
        self.spec = settings.spec
        self.metrics = metrics
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.metrics_url = settings.url + "/metrics"
        self.connections = connections or EngineConnections()
        answered_s = self.spec.zero_confirm_s if answered_s is None else answered_s
        self.patience = Patience(answered_ms=round(answered_s * 1000), tied_ms=round(self.spec.counting_gap_s * 1000))
        self.holding: dict[str, int] = {}
        self.looked: dict[int, Look] = {}  # the connections at the previous look, to tell what happened since
        self.last_error: str | None = None
        self.last_health_error: str | None = None
        self.connections_unknown = False  # no zero is believed while connections cannot be counted

    async def healthy(self) -> tuple[bool, str]:
        """Whether the engine's health URL answers 200, and why not; a change of answer is logged once, with the
        URL, so a sidecar pointed at the wrong port says where it looked."""
        url = self.settings.url + self.settings.health_path
        try:
            async with self.session.get(url, timeout=self.timeout) as response:
                problem = None if response.status == 200 else f"engine health answered HTTP {response.status}"
        except (TimeoutError, aiohttp.ClientError) as error:
            problem = f"engine unreachable at {url}: {type(error).__name__}"
        if problem != self.last_health_error:
            if problem is None:
                log.info("engine.healthy", url=url, after=self.last_health_error)
            else:
                log.warning("engine.unhealthy", url=url, error=problem)
            self.last_health_error = problem
        return (True, "ok") if problem is None else (False, problem)

    async def read(self, *, connections: bool = False) -> Reading:
        """One reading; a part that cannot be read is None, and the failure is logged once and counted.

        ``connections``: also count the connections to the engine's port that may carry a request not yet answered
        (idle keep-alive ones do not count).
        """
        loop = asyncio.get_running_loop()
        # A page shows the engine as it was when asked, at the latest: the reading is timed then.
        asked = loop.time()
        try:
            page = await self._page()
            engine = read_engine(page, self.spec)
        except MetricsError as error:
            self._failed(error.kind, str(error))
            return Reading(at=loop.time(), in_flight=None, connections=await self._connections())
        if self.last_error is not None:
            log.info("engine.read_recovered", after=self.last_error)
            self.last_error = None
        self.metrics.in_flight.set(engine.in_flight)
        reading = Reading(at=asked, in_flight=engine.in_flight, tokens=engine.tokens)
        if connections:
            reading = replace(reading, connections=await self._connections())
        return reading

    async def _connections(self) -> int | None:
        # The scrape's own connection is closed on the next turn of the loop (force_close): let it go first, so it
        # is never counted as a client.
        await asyncio.sleep(0)
        conns = self.connections(self.settings.port)
        if conns is None and not self.connections_unknown:
            log.warning("engine.connections_unknown", port=self.settings.port, tables="/proc/net/tcp, /proc/net/tcp6")
        self.connections_unknown = conns is None
        if conns is None:
            return None
        reasons, self.looked = holding(conns, self.patience, self.looked)
        if reasons != self.holding:
            log.info("engine.connections_holding", port=self.settings.port, open=len(conns), holding=reasons)
            self.holding = reasons
        return sum(reasons.values())

    async def _page(self) -> str:
        try:
            async with self.session.get(self.metrics_url, headers={"Accept": ACCEPT}, timeout=self.timeout) as response:
                if response.status != 200:
                    raise MetricsError("http", f"metrics page answered HTTP {response.status}")
                # The text format is UTF-8 whatever the header says: a charset Python does not know would raise.
                return (await response.read()).decode("utf-8", errors="replace")
        except (TimeoutError, aiohttp.ClientError) as error:
            raise MetricsError(
                "unreachable", f"metrics page {self.metrics_url} unreachable: {type(error).__name__}: {error}"
            ) from None

    def _failed(self, kind: str, message: str) -> None:
        self.metrics.read_errors.labels(kind=kind).inc()
        if message != self.last_error:
            log.warning("engine.read_failed", kind=kind, url=self.metrics_url, error=message)
        self.last_error = message
