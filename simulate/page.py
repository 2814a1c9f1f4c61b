"""A run drawn as a self-contained HTML page: inline CSS and SVG, no script and no external asset.

One lane per pod (in rotation, draining, terminating, gone; evictions refused and done, the engine's exit, lost with
the instance) and one lane per stream (green when it completed intact, red when it was cut), on one time axis with
the notice, the taint, the cordon, a killed node agent and the deadline marked across every lane. The verdict and the
event list follow.
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
POD_H = 30
BAR_TOP, BAR_H = 8, 14  # a pod's bar within its lane: the eviction's mark above it, the engine's exit below
STREAM_H = 11
TOP = 40
GAP = 24
LABEL_Y = 16  # the markers' labels: one row, a label per group of markers too close to label apart
CHAR_W = 6.5  # at least the width of one character of the 11 px labels, to keep them apart

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #1d2330; }
h1 { font-size: 1.4em; margin: 0 0 .2em; } .pass { color: #137333; } .fail { color: #b3261e; }
pre { background: #f5f6f8; padding: 1em; overflow-x: auto; }
svg text { font: 11px system-ui, sans-serif; fill: #1d2330; }
.serving { fill: #34a853; } .draining { fill: #f9ab00; } .drained { fill: #a8c7fa; }
.terminating { fill: #9aa0a6; }
.completed { fill: #34a853; } .cut { fill: #d93025; } .axis { stroke: #c5c9d0; }
.marker { stroke-width: 1.5; } line.notice { stroke: #1a73e8; } line.node { stroke: #9334e6; }
line.agent { stroke: #00796b; stroke-dasharray: 2 2; } line.deadline { stroke: #1d2330; stroke-dasharray: 6 3; }
tspan.notice { fill: #1a73e8; } tspan.node { fill: #9334e6; } tspan.agent { fill: #00796b; }
tspan.deadline { fill: #1d2330; }
.evict { fill: #1d2330; } .refusal { stroke: #d93025; stroke-width: 1.5; } .exit { fill: #1d2330; }
.reclaimed { fill: none; stroke: #1d2330; stroke-width: 2; }
.splice { stroke: #1d2330; stroke-width: 2; }
table.events td { padding: 0 1em 0 0; vertical-align: top; } .legend span { margin-right: 1.5em; white-space: nowrap; }
.swatch { display: inline-block; width: 1em; height: .8em; margin-right: .3em; vertical-align: middle; }
.line { display: inline-block; width: 1.2em; height: 0; margin-right: .3em; vertical-align: middle; }
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
        f'<text x="4" y="{y + BAR_TOP + BAR_H * 0.75}">{_e(pod.name)}</text>',
    ]
    for state, start, stop in _phases(pod, begin=begin, end=end):
        title = f"{pod.name} {state} {start:.2f}-{stop:.2f} s"
        parts.append(_rect(scale, start=start, end=stop, y=y + BAR_TOP, h=BAR_H, cls=state, title=title))
    parts += [_mark(event, scale.x(event.at), y) for event in events if event.pod == pod.name]
    parts.append("</g>")
    return "".join(parts)


def _mark(event: Event, x: float, y: float) -> str:
    """A pod's event as a glyph of its own, each in its band of the lane so that none covers another: the eviction
    above the bar, refusals and the instance's loss on it, the engine's exit below it."""
    tip = f"<title>{_e(f'{event.at:.2f} s {event.text}')}</title>"
    mid, below = y + BAR_TOP + BAR_H / 2, y + BAR_TOP + BAR_H
    if event.kind is Kind.EVICTED:
        return f'<path class="evict" d="M{x - 5},{y}L{x + 5},{y}L{x},{y + BAR_TOP}Z">{tip}</path>'
    if event.kind is Kind.ENGINE_EXITED:
        return f'<rect class="exit" x="{x - 3}" y="{below + 1}" width="6" height="6">{tip}</rect>'
    if event.kind is Kind.EVICTION_BLOCKED:
        cross = f"M{x - 3},{mid - 3}L{x + 3},{mid + 3}M{x - 3},{mid + 3}L{x + 3},{mid - 3}"
        return f'<path class="refusal" d="{cross}">{tip}</path>'
    if event.kind is Kind.RECLAIMED:
        cross = f"M{x - 4},{mid - 4}L{x + 4},{mid + 4}M{x - 4},{mid + 4}L{x + 4},{mid - 4}"
        return f'<g class="reclaimed"><circle cx="{x}" cy="{mid}" r="6"/><path d="{cross}"/>{tip}</g>'
    return ""


def _stream_lane(stream: StreamRecord, scale: Scale, *, y: float) -> str:
    """One lane per stream; a stream the gateway continued changes pod along it, one segment per pod, a tick at each
    splice."""
    segments = stream.segments()
    label = f"#{stream.id} {' → '.join(str(pod) for pod, _, _ in segments)}"
    tokens = f"{stream.outcome.value}, {stream.received}/{stream.wanted} tokens"
    parts = [
        _rect(
            scale,
            start=start,
            end=end,
            y=y + 1,
            h=STREAM_H - 2,
            cls=stream.outcome.value,
            title=f"stream {stream.id} on {pod}, {start:.2f}-{end:.2f} s: {tokens}",
        )
        for pod, start, end in segments
    ]
    parts += [
        f'<line class="splice" x1="{scale.x(at)}" x2="{scale.x(at)}" y1="{y}" y2="{y + STREAM_H}"/>'
        for at, _ in stream.moves
    ]
    return (
        f'<g class="lane stream" data-stream="{stream.id}">'
        f'<text x="4" y="{y + STREAM_H - 2}" font-size="9">{_e(label)}</text>{"".join(parts)}</g>'
    )


Marker = tuple[float, str, str]  # x, class, label


def _marker_list(result: RunResult, scale: Scale) -> list[Marker]:
    s = result.summary
    killed = [e.at for e in result.events if e.kind is Kind.AGENT_KILLED]
    found: list[tuple[float | None, str, str]] = [
        (s.notice_at, "notice", "notice"),
        (s.tainted_at, "node", "taint"),
        (s.cordoned_at, "node", "cordon"),
        *((at, "agent", "agent killed") for at in killed),
        (s.deadline_at, "deadline", "deadline"),
    ]
    # By time alone, so markers at one instant keep the order they happen in (the taint, then the cordon).
    return sorted(((scale.x(at), cls, label) for at, cls, label in found if at is not None), key=lambda m: m[0])


def label_groups(markers: list[Marker]) -> list[list[Marker]]:
    """Markers in groups whose one label, ``a · b · c`` at the first one's x, ends before the next group's begins:
    the notice, the taint and the cordon come within a fraction of a second, too close for labels of their own."""
    groups: list[list[Marker]] = []
    for marker in markers:
        if groups and marker[0] <= groups[-1][0][0] + label_width(groups[-1]) + CHAR_W:
            groups[-1].append(marker)
        else:
            groups.append([marker])
    return groups


def label_width(group: list[Marker]) -> float:
    return len(" · ".join(label for _, _, label in group)) * CHAR_W


def _markers(result: RunResult, scale: Scale, *, height: float) -> Iterator[str]:
    markers = _marker_list(result, scale)
    for x, cls, _ in markers:
        yield f'<line class="marker {cls}" x1="{x}" y1="{LABEL_Y + 4}" x2="{x}" y2="{height}"/>'
    for group in label_groups(markers):
        words = " · ".join(f'<tspan class="{cls}">{_e(label)}</tspan>' for _, cls, label in group)
        yield f'<text class="label" x="{group[0][0] + 3}" y="{LABEL_Y}">{words}</text>'


def timeline_svg(result: RunResult) -> str:
    s = result.summary
    streams = [r for r in result.streams if r.outcome is not Outcome.REFUSED]
    begin = min((e.at for e in result.events if e.kind is Kind.LOAD_STARTED), default=0.0)
    end = max([e.at for e in result.events] + [s.deadline_at or 0.0]) + 0.5
    scale = Scale(max(0.0, begin - 0.5), end)
    height = TOP + len(s.pods) * POD_H + GAP + len(streams) * STREAM_H + 10
    # Room on the right for the last marker's label (the deadline's).
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LABEL_W + PLOT_W + 90}" height="{height + 20}">']
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
    [
        *(
            f'<span><i class="swatch" style="background:{color}"></i>{_e(name)}</span>'
            for name, color in (
                ("pod in rotation", "#34a853"),
                ("draining (out of rotation)", "#f9ab00"),
                ("drained, not yet evicted", "#a8c7fa"),
                ("terminating (evicted)", "#9aa0a6"),
                ("stream completed", "#34a853"),
                ("stream cut", "#d93025"),
            )
        ),
        *(
            f'<span><i class="line" style="border-top: 2px {style} {color}"></i>{_e(name)}</span>'
            for name, style, color in (
                ("notice", "solid", "#1a73e8"),
                ("taint, cordon", "solid", "#9334e6"),
                ("node agent killed", "dotted", "#00796b"),
                ("deadline", "dashed", "#1d2330"),
            )
        ),
        "<span>&#9660; eviction</span><span>&#10005; eviction refused (429)</span>",
        "<span>&#9632; engine exit</span><span>&#8855; lost with the instance</span>",
        "<span>| stream continued on another pod (gateway)</span>",
    ]
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
        f'<p class="legend">{LEGEND}</p>'
        f"{timeline_svg(result)}"
        f"<h2>Verdict</h2><pre>{_e(verdict(result))}</pre>"
        f'<h2>Events</h2><table class="events">{rows}</table>'
        "</body></html>\n"
    )
