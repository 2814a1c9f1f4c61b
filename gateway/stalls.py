"""Streams stalled on a backend that is going away, moved on after a few of its usual gaps, not the read timeout.

vLLM 0.32.0 on SIGTERM (measured, default ``--shutdown-timeout 0``): in 8 of 18 tries an open stream gets no more
bytes and no ``[DONE]`` while the connection stays open, until the client goes. Silence alone is no reason to leave
a backend (a long prefill is silent too), but silence on one that is leaving is: its node has a termination time,
it is out of rotation (its endpoint ``ready: false`` or ``terminating``, its ready URL failing), it no longer
accepts connections, which a probe tells when nothing else does, or another of its streams has just ended with an
error event or an abort. vLLM 0.32.0 stops its engine before its listener, and logs a traceback before each
stream's error event: with 56 streams on a busy 2-core machine, the last heard theirs 5-8 s after the first, the
listener open all the while.

It closes its listener only once its engine has stopped, and a backend that takes no connection takes no new
request whose prefill could pause the others: there, half a second of silence is a stall whatever a stream's gaps
were. So a backend in rotation is probed once a stream of it has been silent that long, not only at its bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import structlog

from gateway.backends import Mover, Pool

log = structlog.get_logger()

STALL_GAPS = 4.0  # a stream this many of its usual gaps silent has stalled...
STALL_MIN_S = 0.5  # ...but never sooner than this (a batch's prefill pauses every stream of an engine)...
STALL_MAX_S = 2.0  # ...and always after this, even before its first gap is known
STALL_CHECK_S = 0.2  # how often streams are looked at
PROBE_TIMEOUT_S = 1.0  # a backend that takes no connection within this is going away
PROBE_EVERY_S = 0.5  # a backend with stalled streams is probed again this often while it takes connections


def stall_bound(gap_s: float | None) -> float:
    """How long a stream whose reads are usually ``gap_s`` apart may be silent before it counts as stalled."""
    if gap_s is None:
        return STALL_MAX_S
    return min(STALL_MAX_S, max(STALL_MIN_S, STALL_GAPS * gap_s))


def stalled(movers: Iterable[Mover], now: float, *, bound_s: float | None = None) -> list[Mover]:
    """The streams among ``movers`` silent past their bound, or past ``bound_s`` where given (those with no response
    yet are not streaming)."""
    return [
        m
        for m in movers
        if not m.moved
        and m.heard_at is not None
        and now - m.heard_at > (stall_bound(m.usual_gap()) if bound_s is None else bound_s)
    ]


async def refuses_connections(url: str, *, timeout_s: float) -> bool:
    """Whether the backend at ``url`` refuses a new TCP connection, or does not take one within ``timeout_s``.

    The kernel's word decides, not this loop's order: a loop held up past ``timeout_s`` (a busy worker) runs the
    timeout together with the finished connect, and the timeout wins; so on a timeout the socket itself is asked
    whether it connected, and a timeout before any connect was tried (a name still resolving, in a thread whose
    answer waits for the held-up loop) says nothing of the backend: not refusing. An IP address is not resolved in
    a thread at all. A backend in rotation that looked refusing would have its stalled streams moved.
    """
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    tried = False
    try:
        async with asyncio.timeout(timeout_s):
            for family, kind, proto, _, address in await _addresses(loop, parts.hostname, port):
                tried = True
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                with contextlib.suppress(OSError):
                    await loop.sock_connect(sock, address)
                    return False
                sock.close()
                sock = None
    except TimeoutError:
        return tried and (sock is None or not _connected(sock))
    except OSError:  # the name does not resolve
        pass
    finally:
        if sock is not None:
            sock.close()
    return True


async def _addresses(loop: asyncio.AbstractEventLoop, host: str | None, port: int) -> list[Any]:
    """``host``'s addresses: at once for an IP address, else from the loop's resolver (a thread)."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):
        return await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def _connected(sock: socket.socket) -> bool:
    """Whether the non-blocking ``sock``'s connect has finished, and without an error."""
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    return bool(poller.poll(0)) and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0


async def stall_watcher(pool: Pool, *, interval_s: float, probe_timeout_s: float) -> None:
    """Every ``interval_s``, moves each stalled stream off a backend that is going away (cause ``stalled``): one
    that refused a connection, each stream silent past ``STALL_MIN_S``; another, each silent past its bound. A
    stream silent past ``STALL_MIN_S`` on a backend still in rotation gets it probed, at most once per
    ``PROBE_EVERY_S``, and a refused probe makes it one that is going away. Runs until cancelled."""
    probed: dict[str, float] = {}  # backend URL -> when it was last probed
    probes: set[asyncio.Task[None]] = set()

    async def probe(url: str) -> None:
        if await refuses_connections(url, timeout_s=probe_timeout_s):
            backend = pool.backend(url)
            if backend is not None and not backend.refused:
                backend.failing = backend.refused = True  # its later stalls move at once
                log.warning("backend.refusing", backend=url)
            _move(url, stalled(pool.holding.get(url, ()), time.monotonic(), bound_s=STALL_MIN_S))

    try:
        while True:
            await pool.relaying()  # no wakeup while no stream is open
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            for url, movers in list(pool.holding.items()):
                quiet = stalled(movers, now, bound_s=STALL_MIN_S)
                if not quiet:
                    continue
                backend = pool.backend(url)
                if backend is not None and backend.refused:  # it has not connected since
                    _move(url, quiet)
                elif pool.going_away(url):
                    _move(url, stalled(quiet, now))
                elif now - probed.get(url, -PROBE_EVERY_S) >= PROBE_EVERY_S:
                    probed[url] = now
                    task = asyncio.create_task(probe(url))
                    probes.add(task)
                    task.add_done_callback(probes.discard)
    finally:
        for task in probes:
            task.cancel()


def _move(url: str, movers: list[Mover]) -> None:
    if movers:
        log.info("gateway.moving", backend=url, streams=len(movers), cause="stalled")
    for mover in movers:
        mover.move("stalled")
