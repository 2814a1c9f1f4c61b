"""From a run's events and streams to the numbers its verdict is judged on: pure, no clock, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from simulate.timeline import Event, Kind, Outcome, StreamRecord


@dataclass(frozen=True)
class Facts:
    """What the fakes and the router can tell at the end of a run, beyond its events."""

    node_patches: int  # PATCHes of the node the fake API served
    node_events: int  # Kubernetes Events written
    rerouted: int  # requests routed while another pod had left rotation
    message_deleted: bool | None = None  # None: the notice did not come through a queue


@dataclass(frozen=True)
class PodSummary:
    name: str
    streams: int
    completed: int
    cut: int
    out_at: float | None  # left rotation (the router's view)
    drained_at: float | None  # the sidecar's drain ended
    evicted_at: float | None
    exited_at: float | None  # the engine process exited
    gone_at: float | None  # removed from the API
    notice_to_out_s: float | None
    last_stream_to_exit_s: float | None
    cut_reported: int | None  # the sidecar's own count; None if it never finished its drain
    cut_by_engine: int | None  # the engine's own count; None if it was killed
    ready_when_evicted: bool | None  # the pod's Ready condition in the API at its eviction; None: never evicted

    @property
    def out_before_eviction(self) -> bool | None:
        """None when the pod was never evicted."""
        if self.evicted_at is None:
            return None
        return self.out_at is not None and self.out_at < self.evicted_at


@dataclass(frozen=True)
class ColdStart:
    """The replacement node's way to its first token, each step's time (None: it never came)."""

    joined_at: float | None
    cache_ready_at: float | None
    fetch_started_at: float | None
    model_ready_at: float | None  # the init container's fetch exited 0
    fetch_code: int | None  # its exit status; None: it never exited
    model_files: int | None  # files on the cache as the check found them
    model_problems: tuple[str, ...]  # what the check of the copy against the source found wrong
    engine_started_at: float | None  # the engine read the model
    engine_files: int | None  # the files it found
    pod_ready_at: float | None
    first_token_at: float | None
    first_token_pod: str | None

    def steps(self, notice_at: float | None) -> list[tuple[str, float | None]]:
        """(step, when) in the order they must come."""
        return [
            ("notice", notice_at),
            ("replacement node joined", self.joined_at),
            ("model fetch started", self.fetch_started_at),
            ("model ready", self.model_ready_at),
            ("engine started", self.engine_started_at),
            ("engine pod ready", self.pod_ready_at),
            ("first token served", self.first_token_at),
        ]


@dataclass(frozen=True)
class Summary:
    notice_at: float | None
    deadline_at: float | None
    tainted_at: float | None
    cordoned_at: float | None
    node_drained_at: float | None  # the node agent's drain returned
    started: int  # streams routed to a pod
    completed: int
    cut: int
    refused: int
    rerouted: int
    cut_reported: int  # what the sidecars counted as cut
    cut_by_engines: int | None  # what the engines counted; None if one was killed before it could say
    notice_to_out_max_s: float | None
    last_stream_to_exit_max_s: float | None
    evictions: int
    eviction_refusals: int  # 429s from a disruption budget, each retried
    evictions_given_up: int
    reclaimed: int  # pods still on the instance at the deadline
    agent_restarts: int
    already_marked: bool  # a restarted agent found the node marked and did not mark it again
    node_patches: int
    node_events: int
    message_deleted: bool | None
    all_gone_at: float | None  # the last pod left the API (None: some never did)
    spare_s: float | None  # deadline minus all_gone_at
    pods: tuple[PodSummary, ...]
    continued: int = 0  # streams the gateway continued on another pod (with --gateway)
    cold_start: ColdStart | None = None  # the replacement node, in the cold-start scenario

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _first(events: Sequence[Event], kind: Kind, pod: str | None = None) -> Event | None:
    return next((e for e in events if e.kind is kind and (pod is None or e.pod == pod)), None)


def _at(event: Event | None) -> float | None:
    return None if event is None else event.at


def _since(later: float | None, earlier: float | None) -> float | None:
    return None if later is None or earlier is None else round(later - earlier, 3)


def _count(event: Event | None, key: str) -> int | None:
    value = None if event is None else event.data.get(key)
    return value if isinstance(value, int) else None


def _flag(event: Event | None, key: str) -> bool | None:
    value = None if event is None else event.data.get(key)
    return value if isinstance(value, bool) else None


def pod_summary(
    name: str, events: Sequence[Event], streams: Sequence[StreamRecord], notice_at: float | None
) -> PodSummary:
    mine = [s for s in streams if s.pod == name]
    exited = _first(events, Kind.ENGINE_EXITED, name)
    out_at = _at(_first(events, Kind.OUT_OF_ROTATION, name))
    # A stream the gateway moved off this pod left it at the move, not at its end on another pod.
    last_end = max((end for s in streams for pod, _, end in s.segments() if pod == name), default=None)
    return PodSummary(
        name=name,
        streams=len(mine),
        completed=sum(s.outcome is Outcome.COMPLETED for s in mine),
        cut=sum(s.outcome is Outcome.CUT for s in mine),
        out_at=out_at,
        drained_at=_at(_first(events, Kind.DRAINED, name)),
        evicted_at=_at(_first(events, Kind.EVICTED, name)),
        exited_at=_at(exited),
        gone_at=_at(_first(events, Kind.POD_REMOVED, name)),
        notice_to_out_s=_since(out_at, notice_at),
        last_stream_to_exit_s=_since(_at(exited), last_end),
        cut_reported=_count(_first(events, Kind.DRAINED, name), "streams_cut"),
        cut_by_engine=_count(exited, "cut"),
        ready_when_evicted=_flag(_first(events, Kind.EVICTED, name), "ready"),
    )


def cold_start(events: Sequence[Event]) -> ColdStart | None:
    """The replacement node's steps; None when no node joined."""
    joined = _first(events, Kind.NODE_JOINED)
    if joined is None:
        return None
    ready, failed = _first(events, Kind.MODEL_READY), _first(events, Kind.FETCH_FAILED)
    engine, token = _first(events, Kind.ENGINE_STARTED), _first(events, Kind.FIRST_TOKEN)
    problems = [] if ready is None else ready.data.get("problems", [])
    return ColdStart(
        joined_at=joined.at,
        cache_ready_at=_at(_first(events, Kind.CACHE_READY)),
        fetch_started_at=_at(_first(events, Kind.FETCH_STARTED)),
        model_ready_at=_at(ready),
        fetch_code=_count(ready or failed, "code"),
        model_files=_count(ready, "files"),
        model_problems=tuple(str(p) for p in problems),
        engine_started_at=_at(engine),
        engine_files=_count(engine, "files"),
        pod_ready_at=_at(_first(events, Kind.POD_READY)),
        first_token_at=_at(token),
        first_token_pod=None if token is None else token.pod,
    )


def _largest(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def summarize(
    events: Sequence[Event], streams: Sequence[StreamRecord], *, pods: Sequence[str], facts: Facts
) -> Summary:
    """The run in numbers; ``pods`` names the pods the node started with."""
    notice_at = _at(_first(events, Kind.NOTICE))
    deadline_at = _at(_first(events, Kind.DEADLINE))
    per_pod = tuple(pod_summary(name, events, streams, notice_at) for name in pods)
    gone = [p.gone_at for p in per_pod]
    all_gone_at = None if any(g is None for g in gone) else _largest(gone)
    engines = [p.cut_by_engine for p in per_pod]

    def count(kind: Kind) -> int:
        return sum(e.kind is kind for e in events)

    return Summary(
        notice_at=notice_at,
        deadline_at=deadline_at,
        tainted_at=_at(_first(events, Kind.TAINTED)),
        cordoned_at=_at(_first(events, Kind.CORDONED)),
        node_drained_at=_at(_first(events, Kind.NODE_DRAINED)),
        started=sum(s.outcome is not Outcome.REFUSED for s in streams),
        completed=sum(s.outcome is Outcome.COMPLETED for s in streams),
        cut=sum(s.outcome is Outcome.CUT for s in streams),
        refused=sum(s.outcome is Outcome.REFUSED for s in streams),
        rerouted=facts.rerouted,
        cut_reported=sum(p.cut_reported or 0 for p in per_pod),
        cut_by_engines=None if any(c is None for c in engines) else sum(c or 0 for c in engines),
        notice_to_out_max_s=_largest([p.notice_to_out_s for p in per_pod]),
        last_stream_to_exit_max_s=_largest([p.last_stream_to_exit_s for p in per_pod]),
        evictions=count(Kind.EVICTED),
        eviction_refusals=count(Kind.EVICTION_BLOCKED),
        evictions_given_up=count(Kind.EVICTION_FAILED),
        reclaimed=count(Kind.RECLAIMED),
        agent_restarts=max(0, count(Kind.AGENT_STARTED) - 1),
        already_marked=count(Kind.ALREADY_MARKED) > 0,
        node_patches=facts.node_patches,
        node_events=facts.node_events,
        message_deleted=facts.message_deleted,
        all_gone_at=all_gone_at,
        spare_s=_since(deadline_at, all_gone_at),
        pods=per_pod,
        continued=count(Kind.CONTINUED),
        cold_start=cold_start(events),
    )
