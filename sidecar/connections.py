"""Which connections to the engine's port hold a drain: those that may carry a request the engine has not answered.

A client's pool keeps a connection open long after its last response (aiohttp 15 s, httpx 5 s, Envoy an hour), and
so does a health checker: counted as streams, they hold a drain until they close. The kernel says, per connection,
when data last went each way (``tcpi_last_data_recv`` / ``tcpi_last_data_sent``, with the granularity of its
clock tick) and what is still queued. A request shows as data in after the last data out; an idle pooled connection
as data out (a response) and nothing since. Where the kernel cannot be asked (no sock_diag), every established
connection holds, as a client may be waiting on any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from sidecar import netstat, sockdiag
from sidecar.sockdiag import DiagError, TcpConn

log = structlog.get_logger()


@dataclass(frozen=True)
class Patience:
    """How long a connection may look answered while a request on it still runs uncounted, in milliseconds."""

    # After its last bytes out: the engine's gauge may drop before the end of a response, by up to the page's lag
    # (the confirmation window), so a pause that short may still be inside one.
    answered_ms: int
    # When data went out and came in within one clock tick, which came last is unknown: a request may have followed
    # the response at once, and may go uncounted until about its first token (the engine's counting gap).
    tied_ms: int


@dataclass(frozen=True)
class Look:
    """A connection as the previous look found it, and why it held then (None: it did not)."""

    conn: TcpConn
    reason: str | None


def _both_ways(before: TcpConn, now: TcpConn) -> tuple[bool, bool] | None:
    """Whether bytes came in, and went out, since ``before``; None where the kernel gave no byte counts."""
    if before.send_queue or before.recv_queue:
        return None
    if before.bytes_received is None or now.bytes_received is None:
        return None
    if before.bytes_acked is None or now.bytes_acked is None:
        return None
    return now.bytes_received > before.bytes_received, now.bytes_acked > before.bytes_acked


def _tie(conn: TcpConn, patience: Patience, before: Look | None) -> str | None:
    """Data went out and came in within one clock tick: which came last is unknown, unless an earlier look tells.

    Bytes both ways since a look that found the connection idle, or tied in the same way, are a request and its
    answer: a request right after an answer would need a whole exchange and another request since that look, the
    last two inside one tick (a keep-alive health check, answered within a tick, ties on every look). Nothing
    since a look that found it idle leaves it idle. A look that found a response under way tells nothing: its end
    and a request that followed at once are what a tie looks like."""
    if before is not None and before.conn.cookie == conn.cookie and before.reason in (None, "same tick"):
        moved = _both_ways(before.conn, conn)
        if moved == (True, True) or (moved == (False, False) and before.reason is None):
            return None
    return "same tick" if (conn.last_sent_ms or 0) < patience.tied_ms else None


def why_held(conn: TcpConn, patience: Patience, before: Look | None = None) -> str | None:
    """Why ``conn`` may carry a request not yet answered, or None when it has been idle since its last response.
    ``before``: the same connection at the previous look, if it was there."""
    if conn.recv_queue or conn.send_queue:
        return "bytes queued"
    if conn.last_sent_ms is None or conn.last_recv_ms is None:
        return "no tcp_info"
    if conn.bytes_received and conn.bytes_acked == 0:
        return "request never answered"
    if conn.last_recv_ms < conn.last_sent_ms:
        return "request after the last response"
    if conn.last_recv_ms == conn.last_sent_ms:
        return _tie(conn, patience, before)
    return "response just sent" if conn.last_sent_ms < patience.answered_ms else None


def holding(
    conns: list[TcpConn], patience: Patience, looked: dict[int, Look] | None = None
) -> tuple[dict[str, int], dict[int, Look]]:
    """How many connections hold the drain, by reason, and this look, for the next one."""
    reasons: dict[str, int] = {}
    now: dict[int, Look] = {}
    for conn in conns:
        reason = why_held(conn, patience, (looked or {}).get(conn.cookie))
        now[conn.cookie] = Look(conn, reason)
        if reason is not None:
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons, now


Dump = Callable[[int], list[TcpConn]]


class EngineConnections:
    """Reads the connections to the engine's port from sock_diag, falling back to /proc/net/tcp (which says only that
    a connection is open, so each one holds) whenever sock_diag fails; each change of source is logged once."""

    def __init__(
        self,
        *,
        dump: Dump | None = None,
        tables: tuple[Path, ...] = netstat.TABLES,
        timeout_s: float = 0.25,
    ) -> None:
        self.dump: Dump = dump or (lambda port: sockdiag.dump(port, timeout_s=timeout_s))
        self.tables = tables
        self.source: str | None = None  # "sock_diag" or "/proc/net/tcp", once read

    def __call__(self, port: int) -> list[TcpConn] | None:
        """The connections; None when neither source can be read."""
        try:
            conns = self.dump(port)
        except (OSError, DiagError) as error:
            self._switch("/proc/net/tcp", port=port, error=f"{type(error).__name__}: {error}")
            return netstat.established_connections(port, self.tables)
        self._switch("sock_diag", port=port)
        return conns

    def _switch(self, source: str, *, port: int, error: str | None = None) -> None:
        if source == self.source:
            return
        self.source = source
        if error is None:
            log.info("engine.connections_judged", port=port, source=source)
        else:
            log.warning(
                "engine.connections_unjudged",
                port=port,
                error=error,
                source=source,
                effect="every established connection holds a drain, idle keep-alive ones included",
            )
