"""The sidecar's decisions, as pure functions of readings and time.

Phases only move forward: SERVING -> DRAINING -> DRAINED. While draining, each reading of the engine either leaves
the drain running or ends it with an outcome:

- ``drained``: in-flight was 0 on consecutive readings spanning the engine's reporting interval (``zero_confirm_s``:
  a page can lag the engine by that much), or on one reading that much after the endpoints caught up (it shows the
  engine after the last request could arrive), and, at the last of them, no connection to the engine's port could
  still carry a request (``sidecar.connections``: a request not yet counted, bytes a client has still to read; idle
  keep-alive connections do not count);
- ``stalled``: in-flight unchanged, the token counter on the page and still, and no such connection for
  ``stall_after_s`` (vLLM's gauges can stay non-zero after clients went away). Without a token counter nothing
  says the engine is stuck: a count that does not change is what running streams look like (Ray's exports, every
  second or ten, hold it still between two), so such a drain ends drained or at the deadline;
- ``timeout``: the deadline passed; the streams still counted then are the ones cut.

A failed reading (engine unreachable, page malformed) is never a zero: it ends nothing and restarts the quiet period.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    DRAINED = "drained"


class Outcome(enum.Enum):
    DRAINED = "drained"
    STALLED = "stalled"
    TIMEOUT = "timeout"


def advance(phase: Phase, to: Phase) -> Phase:
    """The phase after asking to move to ``to``: never backwards, never skipping the drain."""
    order = list(Phase)
    if order.index(to) == order.index(phase) + 1:
        return to
    return phase


@dataclass(frozen=True)
class Reading:
    """One look at the engine, ``at`` on the loop's monotonic clock. None means that part could not be read."""

    at: float
    in_flight: int | None
    tokens: float | None = None
    connections: int | None = None  # connections that may still carry a request (idle ones left out)


@dataclass(frozen=True)
class Drain:
    """Progress of one drain."""

    started_at: float
    deadline: float
    settled_at: float | None = None  # when the endpoints had caught up: no request arrives after
    zero_since: float | None = None  # the first reading of the current run of zeros
    last: Reading | None = None
    quiet_since: float | None = None
    last_in_flight: int | None = None  # the newest successful reading, for counting cut streams


def _still(previous: Reading | None, reading: Reading) -> bool:
    """Nothing moved since ``previous``: the same non-zero count and a token counter that stood still."""
    return (
        previous is not None
        and reading.in_flight is not None
        and reading.in_flight > 0
        and reading.tokens is not None
        and reading.in_flight == previous.in_flight
        and reading.tokens == previous.tokens
    )


def _quiet(previous: Reading | None, reading: Reading) -> bool:
    return _still(previous, reading) and reading.connections == 0


def _zero_confirmed(drain: Drain, reading: Reading, zero_confirm_s: float) -> bool:
    """In-flight 0 now, and on the readings before for at least ``zero_confirm_s`` or read at least that long after
    the endpoints caught up (a page lagging by up to that much then shows a moment no request arrives after)."""
    if reading.in_flight != 0:
        return False
    if drain.settled_at is not None and reading.at - drain.settled_at >= zero_confirm_s:
        return True
    return drain.zero_since is not None and reading.at - drain.zero_since >= zero_confirm_s


def observe(
    drain: Drain, reading: Reading, *, stall_after_s: float, zero_confirm_s: float
) -> tuple[Drain, Outcome | None]:
    """Fold one reading into the drain and say whether it has ended."""
    drained = _zero_confirmed(drain, reading, zero_confirm_s) and reading.connections == 0
    zero_since = (drain.zero_since if drain.zero_since is not None else reading.at) if reading.in_flight == 0 else None
    quiet_since = (
        (drain.quiet_since if drain.quiet_since is not None else reading.at) if _quiet(drain.last, reading) else None
    )
    last_in_flight = drain.last_in_flight if reading.in_flight is None else reading.in_flight
    drain = replace(drain, zero_since=zero_since, last=reading, quiet_since=quiet_since, last_in_flight=last_in_flight)
    if drained:
        return drain, Outcome.DRAINED
    if quiet_since is not None and reading.at - quiet_since >= stall_after_s:
        return drain, Outcome.STALLED
    if reading.at >= drain.deadline:
        return drain, Outcome.TIMEOUT
    return drain, None


def streams_cut(drain: Drain, outcome: Outcome) -> int:
    """Streams a drain ended while they still ran: the last in-flight count, on timeout only."""
    if outcome is not Outcome.TIMEOUT:
        return 0
    if drain.last_in_flight is not None:
        return drain.last_in_flight
    return drain.last.connections or 0 if drain.last is not None else 0


def next_poll_delay(drain: Drain, now: float, *, poll_interval_s: float, zero_confirm_s: float) -> float:
    """How long to wait before the next reading: a zero is confirmed as soon as its run spans ``zero_confirm_s``
    or it is that long after the endpoints caught up (a tenth of a poll interval after it at the soonest), and no
    wait runs past the deadline."""
    wait = poll_interval_s
    if drain.zero_since is not None and drain.last is not None:
        starts = drain.zero_since if drain.settled_at is None else min(drain.zero_since, drain.settled_at)
        remaining = starts + zero_confirm_s - now
        if remaining > 0 or drain.last.at == drain.zero_since:
            wait = min(poll_interval_s, max(poll_interval_s / 10, remaining))
    return max(0.0, min(wait, drain.deadline - now))
