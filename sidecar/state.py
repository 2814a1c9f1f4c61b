"""The sidecar's decisions, as pure functions of readings and time.

Phases only move forward: SERVING -> DRAINING -> DRAINED. While draining, each reading of the engine either leaves
the drain running or ends it with an outcome:

- ``drained``: in-flight was 0 on two consecutive readings;
- ``stalled``: in-flight unchanged, the token counter still and no client connected for ``stall_after_s``
  (vLLM's gauges can stay non-zero after clients went away);
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
    connections: int | None = None


@dataclass(frozen=True)
class Drain:
    """Progress of one drain."""

    started_at: float
    deadline: float
    zeros: int = 0
    last: Reading | None = None
    quiet_since: float | None = None
    last_in_flight: int | None = None  # the newest successful reading, for counting cut streams


def _quiet(previous: Reading | None, reading: Reading) -> bool:
    return (
        previous is not None
        and reading.in_flight is not None
        and reading.in_flight == previous.in_flight
        and reading.tokens == previous.tokens
        and reading.connections == 0
    )


def needs_connections(previous: Reading | None, reading: Reading) -> bool:
    """Whether the stall rule needs this reading's connection count: only when nothing else has moved."""
    return (
        previous is not None
        and reading.in_flight is not None
        and reading.in_flight > 0
        and reading.in_flight == previous.in_flight
        and reading.tokens == previous.tokens
    )


def observe(drain: Drain, reading: Reading, *, stall_after_s: float) -> tuple[Drain, Outcome | None]:
    """Fold one reading into the drain and say whether it has ended."""
    zeros = drain.zeros + 1 if reading.in_flight == 0 else 0
    quiet_since = (
        (drain.quiet_since if drain.quiet_since is not None else reading.at) if _quiet(drain.last, reading) else None
    )
    last_in_flight = drain.last_in_flight if reading.in_flight is None else reading.in_flight
    drain = replace(drain, zeros=zeros, last=reading, quiet_since=quiet_since, last_in_flight=last_in_flight)
    if zeros >= 2:
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


def next_poll_delay(drain: Drain, now: float, *, poll_interval_s: float) -> float:
    """How long to wait before the next reading: a zero is confirmed sooner, and never past the deadline."""
    wait = poll_interval_s / 10 if drain.zeros == 1 else poll_interval_s
    return max(0.0, min(wait, drain.deadline - now))
