"""A run as people read it: a header, one line per event, and the verdict table; or the same as JSON."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from simulate.run import RunResult
from simulate.scenarios import Scenario
from simulate.settings import SimulationSettings
from simulate.summary import ColdStart, PodSummary, Summary
from simulate.timeline import STREAM_KINDS, Event, Kind
from spotdrain.settings import plain


def _engine(settings: SimulationSettings) -> str:
    return " (lengths; real vLLM 0.32.0 paces them itself)" if settings.engine == "vllm" else ""


def header(settings: SimulationSettings, scenario: Scenario) -> str:
    t = settings.timings
    return "\n".join(
        [
            f"spotdrain simulate: {scenario.name}",
            f"  {scenario.title}",
            f"  {settings.pods} pods on one node{_spare(settings)}, {settings.streams_per_pod} streams each at "
            f"{settings.tokens_per_s:g} tokens/s{_engine(settings)}; a notice of {t.notice_s:g} s stands for the 120 s "
            "of a Spot warning",
            f"  sidecars: drain timeout {t.window_s:g} s, endpoint delay {t.endpoint_delay_s:g} s; "
            f"node agent: eviction margin {t.eviction_margin_s:g} s, eviction delay {t.eviction_delay_s:g} s",
            f"  expected: {GATEWAY_EXPECTATION if settings.gateway else scenario.expectation}",
            "",
            f"{'time':>10}  {'who':<12}  what",
        ]
    )


GATEWAY_EXPECTATION = "no stream is cut: the gateway continues every stream a pod cannot finish on the second node"


def _spare(settings: SimulationSettings) -> str:
    if not settings.gateway:
        return ""
    return f" and {settings.pods} on a second node that stays, clients through spotdrain gateway"


def event_line(event: Event) -> str:
    return f"{event.at:8.2f} s  {event.subject:<12}  {event.text}"


def shown(event: Event, *, notice_at: float | None) -> bool:
    """Stream ends before the notice are only load; they are left to the HTML and JSON."""
    return event.kind not in STREAM_KINDS or (notice_at is not None and event.at >= notice_at)


def live_printer(write: Callable[[str], None]) -> Callable[[Event], None]:
    """A sink that prints each event as it is recorded, from the same rules as the full report."""
    notice_at: list[float] = []

    def sink(event: Event) -> None:
        if event.kind is Kind.NOTICE and not notice_at:
            notice_at.append(event.at)
        if shown(event, notice_at=notice_at[0] if notice_at else None):
            write(event_line(event))

    return sink


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _per_pod(pods: Sequence[PodSummary], value: Callable[[PodSummary], float | None]) -> str:
    return ", ".join(f"{p.name} {_s(value(p))}" for p in pods)


def _after_notice(s: Summary, at: float | None) -> str:
    return "-" if at is None or s.notice_at is None else f"{at - s.notice_at:.2f} s"


def _cold_start(s: Summary, c: ColdStart) -> str:
    fetch = "-" if c.model_ready_at is None or c.fetch_started_at is None else _s(c.model_ready_at - c.fetch_started_at)
    return (
        f"joined {_after_notice(s, c.joined_at)}, model ready {_after_notice(s, c.model_ready_at)} (fetch {fetch}), "
        f"first token {_after_notice(s, c.first_token_at)} after the notice"
    )


def verdict(result: RunResult) -> str:
    s = result.summary
    engines = "-" if s.cut_by_engines is None else str(s.cut_by_engines)
    spare = "-" if s.spare_s is None else f"empty {s.spare_s:.1f} s before it"
    rows = [
        ("streams started", str(s.started)),
        ("completed intact", str(s.completed)),
        ("cut", f"{s.cut}  (sidecars reported {s.cut_reported}, engines counted {engines})"),
        ("new requests refused / rerouted", f"{s.refused} / {s.rerouted}"),
        (
            "notice to out of rotation",
            f"max {_s(s.notice_to_out_max_s)}  ({_per_pod(s.pods, lambda p: p.notice_to_out_s)})",
        ),
        (
            "last stream to engine exit",
            f"max {_s(s.last_stream_to_exit_max_s)}  ({_per_pod(s.pods, lambda p: p.last_stream_to_exit_s)})",
        ),
        (
            "evictions",
            f"{s.evictions} done, {s.eviction_refusals} refused by the budget (429) and retried, "
            f"{s.evictions_given_up} given up",
        ),
        (
            "node",
            f"tainted {_after_notice(s, s.tainted_at)}, cordoned {_after_notice(s, s.cordoned_at)} after the "
            f"notice; {s.node_patches} patch(es), {s.node_events} Event(s)",
        ),
        ("deadline", f"{result.deadline}; node {spare}" if s.reclaimed == 0 else f"{s.reclaimed} pods lost with it"),
    ]
    if s.agent_restarts:
        rows.append(("node agent", f"restarted {s.agent_restarts}x; found the node marked: {s.already_marked}"))
    if s.cold_start is not None:
        rows.append(("replacement node", _cold_start(s, s.cold_start)))
    if s.message_deleted is not None:
        rows.append(("queue", "message deleted" if s.message_deleted else "message NOT deleted"))
    lines = [f"verdict: {'PASS' if result.passed else 'FAIL'} ({result.scenario.name})"]
    lines += [f"  {name:<32}  {value}" for name, value in rows]
    lines += ["checks"]
    lines += [f"  {'pass' if c.passed else 'FAIL'}  {c.name}: {c.detail}" for c in result.checks]
    return "\n".join(lines)


def render(result: RunResult) -> str:
    """The whole report: header, timeline and verdict."""
    lines = [header(result.settings, result.scenario)]
    lines += [event_line(e) for e in result.events if shown(e, notice_at=result.summary.notice_at)]
    return "\n".join([*lines, "", verdict(result)])


def as_json(result: RunResult) -> dict[str, Any]:
    settings = plain(result.settings)
    return {
        "scenario": result.scenario.name,
        "title": result.scenario.title,
        "expectation": result.scenario.expectation,
        "passed": result.passed,
        "deadline": result.deadline,
        "settings": settings,
        "summary": result.summary.as_dict(),
        "checks": [dataclasses.asdict(check) for check in result.checks],
        "events": [event.as_dict() for event in result.events],
        "streams": [stream.as_dict() for stream in result.streams],
    }
