"""What a run saw, as data on one clock: events from every part of the simulation and the streams of the load.

Times are seconds since the run started (the loop's monotonic clock). The ``Recorder`` is the only part that reads a
clock, and it is handed one; everything that judges a run works on the recorded data alone (see ``summary``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class Kind(enum.StrEnum):
    LOAD_STARTED = "load_started"
    NOTICE = "notice"  # delivered to IMDS or to the queue
    AGENT_STARTED = "agent_started"
    AGENT_KILLED = "agent_killed"
    AGENT_NOTICE = "agent_notice"  # the node agent has read it
    ALREADY_MARKED = "already_marked"
    TAINTED = "tainted"
    CORDONED = "cordoned"
    OUT_OF_ROTATION = "out_of_rotation"
    DRAIN_STARTED = "drain_started"
    DRAINED = "drained"  # the sidecar's drain ended; data: outcome, streams_cut
    EVICTION_BLOCKED = "eviction_blocked"  # 429 from a PodDisruptionBudget, to be retried
    EVICTION_FAILED = "eviction_failed"  # the agent gave up on it
    EVICTED = "evicted"  # the pod's deletion began; data: grace_s, ready (its Ready condition then)
    PRESTOP_RETURNED = "prestop_returned"
    ENGINE_EXITED = "engine_exited"  # data: code, cut (the engine's own count, None if it was killed)
    SIDECAR_EXITED = "sidecar_exited"
    KILLED = "killed"  # SIGKILL at the end of the grace period
    POD_REMOVED = "pod_removed"
    NODE_DRAINED = "node_drained"  # the node agent's drain returned
    MESSAGE_DELETED = "message_deleted"
    RECLAIMED = "reclaimed"  # a pod still on the instance when it was reclaimed
    DEADLINE = "deadline"
    CONTINUED = "continued"  # the gateway continued a broken stream on another pod
    # cold-start: the node that replaces the interrupted one, from its joining to its first token
    NODE_JOINED = "node_joined"
    CACHE_READY = "cache_ready"  # its cache mounted: labelled spotdrain.io/model-cache=ready, startup taint removed
    FETCH_STARTED = "fetch_started"  # the init container's fetch listed the model and began copying it
    MODEL_READY = "model_ready"  # the fetch exited 0; data: code, files, bytes, problems (the copy against the source)
    FETCH_FAILED = "fetch_failed"  # the fetch exited non-zero; data: code
    ENGINE_STARTED = "engine_started"  # the engine read the model; data: files (as many as it found)
    POD_READY = "pod_ready"  # its sidecar's /ready answered 200
    FIRST_TOKEN = "first_token"  # a client's first token from the new pod
    STREAM_COMPLETED = "stream_completed"
    STREAM_CUT = "stream_cut"
    REFUSED = "refused"


STREAM_KINDS = frozenset({Kind.STREAM_COMPLETED, Kind.STREAM_CUT, Kind.REFUSED})


@dataclass(frozen=True)
class Event:
    at: float
    kind: Kind
    subject: str  # who it happened to, as a person reads it: "node gpu-1", "vllm-0", "stream 7", "node agent"
    text: str
    pod: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": round(self.at, 3),
            "kind": self.kind.value,
            "subject": self.subject,
            "text": self.text,
            "pod": self.pod,
            **({"data": dict(self.data)} if self.data else {}),
        }


class Outcome(enum.StrEnum):
    COMPLETED = "completed"  # every token and [DONE]
    CUT = "cut"  # began, and ended before its last token
    REFUSED = "refused"  # the router had no pod in rotation


@dataclass(frozen=True)
class StreamRecord:
    id: int  # streams count 1, 2, ... as they are routed; refused requests count apart, from 1 too
    slot: int  # the load generator's concurrent slot that opened it
    pod: str | None  # None when refused
    started: float
    ended: float
    wanted: int  # tokens asked for
    received: int
    outcome: Outcome
    moves: tuple[tuple[float, str], ...] = ()  # continued by the gateway: (when, the pod it went on to), in order

    def segments(self) -> list[tuple[str | None, float, float]]:
        """(pod, from, to) for each pod the stream was on, in order: one, unless the gateway continued it."""
        pods = [self.pod, *(pod for _, pod in self.moves)]
        starts = [self.started, *(at for at, _ in self.moves)]
        return list(zip(pods, starts, [*starts[1:], self.ended], strict=True))

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "slot": self.slot,
            "pod": self.pod,
            "started": round(self.started, 3),
            "ended": round(self.ended, 3),
            "wanted": self.wanted,
            "received": self.received,
            "outcome": self.outcome.value,
            "moves": [{"at": round(at, 3), "pod": pod} for at, pod in self.moves],
        }


def stream_event(record: StreamRecord) -> Event:
    """The event a stream's end adds to the timeline."""
    if record.outcome is Outcome.REFUSED:
        text = f"refused (503): no pod in rotation; its client stops (refusal {record.id})"
        return Event(record.ended, Kind.REFUSED, "new request", text)
    subject = f"stream {record.id}"
    if record.outcome is Outcome.COMPLETED:
        text = f"completed intact on {record.pod} ({record.received} tokens)"
        return Event(record.ended, Kind.STREAM_COMPLETED, subject, text, pod=record.pod)
    text = f"CUT on {record.pod} after {record.received} of {record.wanted} tokens"
    return Event(record.ended, Kind.STREAM_CUT, subject, text, pod=record.pod)


class Recorder:
    """Collects events and stream records against ``clock``; hands each event to ``sink`` as it is recorded."""

    def __init__(self, clock: Callable[[], float], *, sink: Callable[[Event], None] | None = None) -> None:
        self._clock = clock
        self._t0 = clock()
        self._sink = sink
        self.events: list[Event] = []
        self.streams: list[StreamRecord] = []

    def now(self) -> float:
        return self._clock() - self._t0

    def record(
        self, kind: Kind, subject: str, text: str, *, pod: str | None = None, at: float | None = None, **data: Any
    ) -> Event:
        event = Event(self.now() if at is None else at, kind, subject, text, pod=pod, data=data)
        self._add(event)
        return event

    def stream(self, record: StreamRecord) -> None:
        self.streams.append(record)
        self._add(stream_event(record))

    def _add(self, event: Event) -> None:
        self.events.append(event)
        if self._sink is not None:
            self._sink(event)

    def first(self, kind: Kind, *, pod: str | None = None) -> Event | None:
        return next((e for e in self.events if e.kind is kind and (pod is None or e.pod == pod)), None)
