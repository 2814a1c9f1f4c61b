"""A backend's connections kept open between streams, as the Rust routers keep theirs: a stream's start then skips a
connect and a close (46 µs of the gateway's CPU each, measured with bench/gateway_peers.py's backend).

A connection comes back once its stream has ended whole (``Answer.release``), is taken again by the next stream to
that backend, newest first, for ``MAX_AGE_S`` after it was made, and is closed after ``IDLE_S`` unused, when the
backend goes out of rotation, or at once when the backend closes it (vLLM's uvicorn closes an idle one after 5 s). An
engine's sidecar does not count an idle connection as a client (sidecar/connections.py), and one it cannot tell (its
``/proc/net/tcp`` fallback) is closed by the engine, or here when the sidecar's ``/ready`` turns the backend out of
rotation.
"""

from __future__ import annotations

import asyncio
import time

from spotdrain.http1_reads import Reads

IDLE_S = 30.0  # above uvicorn's 5 s: the engine closes first, and its close takes the connection out here
# A connection is taken again for this long after it was made, and no longer. Behind one URL (a Service, where the
# gateway is not given the pods: ``--backend``, not ``--service``) a kept connection stays with the pod it reached,
# out of rotation or not: a new connection goes where the Service now sends it.
MAX_AGE_S = 10.0
MOST = 1024  # idle connections kept to one backend; past this, the oldest is closed


class Kept:
    """One backend's idle connections, oldest first."""

    __slots__ = ("_idle", "_timer")

    def __init__(self) -> None:
        self._idle: dict[Reads, float] = {}  # connection -> monotonic time it came back
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._idle)

    def take(self) -> Reads | None:
        """The newest idle connection still fit for a request and made less than ``MAX_AGE_S`` ago, or None; those
        found otherwise on the way are closed."""
        now = time.monotonic()
        while self._idle:
            protocol, _ = self._idle.popitem()
            if protocol.idle and now - protocol.born < MAX_AGE_S:
                return protocol
            protocol.close()
        return None

    def keep(self, protocol: Reads) -> None:
        """A connection whose answer has ended, or is ending (its chunked end still to come: it is not fit before)."""
        self._idle[protocol] = time.monotonic()
        if len(self._idle) > MOST:
            oldest = next(iter(self._idle))
            del self._idle[oldest]
            oldest.close()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(IDLE_S, self._expire)

    def close(self) -> None:
        """Close every idle connection (the backend is out of rotation, or gone)."""
        for protocol in self._idle:
            protocol.close()
        self._idle.clear()

    def _expire(self) -> None:
        """Close the connections idle ``IDLE_S`` or longer, then look again when the oldest left is due (those the
        backend closed meanwhile are passed over by ``take``, or go here in turn)."""
        self._timer = None
        now = time.monotonic()
        while self._idle:
            oldest, at = next(iter(self._idle.items()))
            if now - at < IDLE_S:
                self._timer = asyncio.get_running_loop().call_later(max(at + IDLE_S - now, 1.0), self._expire)
                return
            del self._idle[oldest]
            oldest.close()
