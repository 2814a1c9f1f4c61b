"""A run drawn as a self-contained HTML page: inline CSS and SVG, no script and no external asset.

One lane per pod (in rotation, draining, terminating, gone; evictions refused and done, the engine's exit) and one
lane per stream (green when it completed intact, red when it was cut), on one time axis with the notice, the taint,
the cordon and the deadline marked across every lane. The verdict and the event list follow.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterator

from simulate.report import verdict
from simulate.run import RunResult
from simulate.summary import PodSummary
from simulate.timeline import Event, Kind, Outcome, StreamRecord

LABEL_W = 150
PLOT_W = 900
POD_H = 26
STREAM_H = 11
TOP = 60
GAP = 24

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #1d2330; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } .pass { color: #137333; } .fail { color: #b3261e; }
pre { background: #f5f6f8; padding: 1em; overflow-x: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #1d2330; }
.serving { fill: #34a853; } .draining { fill: #f9ab00; } .drained { fill: #a8c7fa; }
.terminating { fill: #9aa0a6; }
.completed { fill: #34a853; } .cut { fill: #d93025; } .axis { stroke: #c5c9d0; }
.marker { stroke-width: 1.5; } .notice { stroke: #1a73e8; } .node { stroke: #9334e6; } .deadline { stroke: #d93025; }
.evict { fill: #1d2330; } .refusal { stroke: #d93025; stroke-width: 1.5; } .exit { fill: #1d2330; }
table.events td { padding: 0 1em 0 0; vertical-align: top; } .legend span { margin-right: 1.5em; }
.swatch { display: inline-block; width: 1em; height: .8em; margin-right: .3em; vertical-align: middle; }
"""


class Scale:
    """Seconds of the run to x pixels of the plot."""

    def __init__(self, start: float, end: float) -> None:
        self.start = start
        self.span = max(end - start, 0.1)

    def x(self, at: float) -> float:
        return round(LABEL_W + (at - self.start) / self.span * PLOT_W, 1)

    def ticks(self) -> Iterator[float]:
        step = next((s for s in (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300) if self.span / s <= 12), self.span / 10)
        first = math.ceil(self.start / step) * step
        yield from (first + i * step for i in range(int((self.start + self.span - first) / step) + 1))


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _rect(scale: Scale, *, start: float, end: float, y: float, h: float, cls: str, title: str) -> str:
    width = max(scale.x(end) - scale.x(start), 1.0)
    return (
        f'<rect class="{cls}" x="{scale.x(start)}" y="{y}" width="{width:.1f}" height="{h}">'
        f"<title>{_e(title)}</title></rect>"
    )


def _phases(pod: PodSummary, *, begin: float, end: float) -> Iterator[tuple[str, float, float]]:
    """(state, from, to) of a pod along the run: serving, draining, drained (waiting to be evicted), terminating."""
    marks = [("serving", begin), ("draining", pod.out_at), ("drained", pod.drained_at), ("terminating", pod.evicted_at)]
    if pod.evicted_at is not None and pod.drained_at is not None and pod.drained_at > pod.evicted_at:
        marks.remove(("drained", pod.drained_at))  # it drained while terminating: the eviction came first
    known = sorted(((state, at) for state, at in marks if at is not None), key=lambda mark: mark[1])
    stops = [at for _, at in known[1:]] + [pod.gone_at if pod.gone_at is not None else end]
    for (state, at), stop in zip(known, stops, strict=True):
        yield state, at, max(at, stop)


def _pod_lane(pod: PodSummary, events: tuple[Event, ...], scale: Scale, *, y: float, begin: float, end: float) -> str:
    parts = [
        f'<g class="lane pod" data-pod="{_e(pod.name)}">',
        f'<text x="4" y="{y + POD_H * 0.65}">{_e(pod.name)}</text>',
    ]
    for state, start, stop in _phases(pod, begin=begin, end=end):
        title = f"{pod.name} {state} {start:.2f}-{stop:.2f} s"
        parts.append(_rect(scale, start=start, end=stop, y=y + 4, h=POD_H - 8, cls=state, title=title))
    for event in events:
        if event.pod != pod.name:
            continue
        x, mid = scale.x(event.at), y + POD_H / 2
        tip = f"<title>{_e(f'{event.at:.2f} s {event.text}')}</title>"
        if event.kind is Kind.EVICTION_BLOCKED:
            cross = f"M{x - 3},{mid - 3}L{x + 3},{mid + 3}M{x - 3},{mid + 3}L{x + 3},{mid - 3}"
            parts.append(f'<path class="refusal" d="{cross}">{tip}</path>')
        elif event.kind is Kind.EVICTED:
            parts.append(f'<path class="evict" d="M{x - 5},{y}L{x + 5},{y}L{x},{y + 8}Z">{tip}</path>')
        elif event.kind is Kind.ENGINE_EXITED:
            parts.append(f'<rect class="exit" x="{x - 3}" y="{mid - 3}" width="6" height="6">{tip}</rect>')
    parts.append("</g>")
    return "".join(parts)


def _stream_lane(stream: StreamRecord, scale: Scale, *, y: float) -> str:
    label = f"#{stream.id} {stream.pod}"
    title = (
        f"stream {stream.id} on {stream.pod}: {stream.outcome.value}, {stream.received}/{stream.wanted} tokens, "
        f"{stream.started:.2f}-{stream.ended:.2f} s"
    )
    bar = _rect(
        scale, start=stream.started, end=stream.ended, y=y + 1, h=STREAM_H - 2, cls=stream.outcome.value, title=title
    )
    return (
        f'<g class="lane stream" data-stream="{stream.id}">'
        f'<text x="4" y="{y + STREAM_H - 2}" font-size="9">{_e(label)}</text>{bar}</g>'
    )


def _markers(result: RunResult, scale: Scale, *, height: float) -> Iterator[str]:
    s = result.summary
    # Labels on rows of their own: the notice, the taint and the cordon come within a fraction of a second.
    for row, (at, cls, label) in enumerate(
        (
            (s.notice_at, "notice", "notice"),
            (s.tainted_at, "node", "taint"),
            (s.cordoned_at, "node", "cordon"),
            (s.deadline_at, "deadline", "deadline"),
        )
    ):
        if at is None:
            continue
        x, y = scale.x(at), 14 + (row % 3) * 14
        yield f'<line class="marker {cls}" x1="{x}" y1="{y + 2}" x2="{x}" y2="{height}"/>'
        yield f'<text x="{x + 3}" y="{y}">{label}</text>'


def timeline_svg(result: RunResult) -> str:
    s = result.summary
    streams = [r for r in result.streams if r.outcome is not Outcome.REFUSED]
    begin = min((e.at for e in result.events if e.kind is Kind.LOAD_STARTED), default=0.0)
    end = max([e.at for e in result.events] + [s.deadline_at or 0.0]) + 0.5
    scale = Scale(max(0.0, begin - 0.5), end)
    height = TOP + len(s.pods) * POD_H + GAP + len(streams) * STREAM_H + 10
    # Room on the right for the last marker's label (the deadline's).
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + PLOT_W + 70}" height="{height + 20}">']
    for tick in scale.ticks():
        x = scale.x(tick)
        parts.append(f'<line class="axis" x1="{x}" y1="{TOP}" x2="{x}" y2="{height}"/>')
        parts.append(f'<text x="{x - 8}" y="{height + 14}">{tick:g} s</text>')
    y = float(TOP)
    for pod in s.pods:
        parts.append(_pod_lane(pod, result.events, scale, y=y, begin=begin, end=end))
        y += POD_H
    y += GAP
    for stream in streams:
        parts.append(_stream_lane(stream, scale, y=y))
        y += STREAM_H
    parts.extend(_markers(result, scale, height=height))
    parts.append("</svg>")
    return "".join(parts)


LEGEND = "".join(
    f'<span><i class="swatch" style="background:{color}"></i>{_e(name)}</span>'
    for name, color in (
        ("pod in rotation", "#34a853"),
        ("draining (out of rotation)", "#f9ab00"),
        ("drained, not yet evicted", "#a8c7fa"),
        ("terminating (evicted)", "#9aa0a6"),
        ("stream completed", "#34a853"),
        ("stream cut", "#d93025"),
    )
)


def render_html(result: RunResult) -> str:
    status = "pass" if result.passed else "fail"
    rows = "".join(
        f"<tr><td>{e.at:.2f} s</td><td>{_e(e.subject)}</td><td>{_e(e.text)}</td></tr>" for e in result.events
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>spotdrain simulate: {_e(result.scenario.name)}</title>'
        f"<style>{STYLE}</style></head><body>"
        f'<h1>spotdrain simulate: {_e(result.scenario.name)} <span class="{status}">{status.upper()}</span></h1>'
        f"<p>{_e(result.scenario.title)}. Expected: {_e(result.scenario.expectation)}.</p>"
        f'<p class="legend">{LEGEND} &#9660; eviction &#10005; eviction refused (429) &#9632; engine exit</p>'
        f"{timeline_svg(result)}"
        f"<h2>Verdict</h2><pre>{_e(verdict(result))}</pre>"
        f'<h2>Events</h2><table class="events">{rows}</table>'
        "</body></html>\n"
    )
