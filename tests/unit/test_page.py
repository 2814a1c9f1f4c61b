"""The simulation's picture: every mark readable on its own, none covering another, no two meanings in one colour."""

from __future__ import annotations

import itertools
import re
import xml.dom.minidom
from xml.dom.minidom import Element, Node, Text

import pytest

from simulate.page import CHAR_W, STYLE, render_html, timeline_svg
from simulate.timeline import Event, Kind, Outcome, StreamRecord, stream_event
from tests.unit.test_simulation import PODS, STREAMS, drained_node, ev, result


def svg_of(events: list[Event]) -> Element:
    svg = xml.dom.minidom.parseString(timeline_svg(result(events, STREAMS))).documentElement
    assert svg is not None
    return svg


def text_of(node: Node) -> str:
    return "".join(child.data if isinstance(child, Text) else text_of(child) for child in node.childNodes)


def labels(svg: Element) -> list[tuple[float, float, float, str]]:
    """Each marker label as (left, right, baseline, text), its width at least CHAR_W a character."""
    found = []
    for text in svg.getElementsByTagName("text"):
        if text.getAttribute("class") == "label":
            words = text_of(text)
            left = float(text.getAttribute("x"))
            found.append((left, left + len(words) * CHAR_W, float(text.getAttribute("y")), words))
    return found


def boxes(svg: Element, tag: str, cls: str) -> list[tuple[float, float, float, float]]:
    """(left, top, right, bottom) of every ``tag`` of class ``cls``; paths by the points they are drawn through."""
    found = []
    for element in svg.getElementsByTagName(tag):
        if element.getAttribute("class") != cls:
            continue
        if tag == "rect":
            x, y = float(element.getAttribute("x")), float(element.getAttribute("y"))
            found.append((x, y, x + float(element.getAttribute("width")), y + float(element.getAttribute("height"))))
        else:
            points = [float(n) for n in re.findall(r"-?[\d.]+", element.getAttribute("d"))]
            xs, ys = points[0::2], points[1::2]
            found.append((min(xs), min(ys), max(xs), max(ys)))
    return found


def overlap(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def apart(found: list[tuple[float, float, float, str]]) -> bool:
    spans = sorted((left, right) for left, right, _, _ in found)
    return all(right < next_left for (_, right), (next_left, _) in itertools.pairwise(spans))


def test_the_notice_taint_and_cordon_labels_share_one_row_without_stacking_or_overlapping() -> None:
    found = labels(svg_of(drained_node()))
    assert [text for *_, text in found] == ["notice · taint · cordon", "deadline"]
    assert len({baseline for _, _, baseline, _ in found}) == 1
    assert apart(found)


def test_labels_of_markers_far_apart_stay_apart_and_each_marker_keeps_its_line() -> None:
    events = [*drained_node(), ev(20, Kind.AGENT_KILLED)]
    svg = svg_of(events)
    assert [text for *_, text in labels(svg)] == ["notice · taint · cordon", "agent killed", "deadline"]
    lines = [line.getAttribute("class") for line in svg.getElementsByTagName("line")]
    assert [c for c in lines if c.startswith("marker")] == [
        "marker notice",
        "marker node",
        "marker node",
        "marker agent",
        "marker deadline",
    ]
    assert apart(labels(svg))


def test_an_eviction_and_an_engine_exit_at_the_same_instant_cover_neither_each_other_nor_the_bar() -> None:
    # Each engine exits the instant its pod is evicted.
    events = [e if e.kind is not Kind.ENGINE_EXITED else ev(e.at - 0.6, e.kind, e.pod) for e in drained_node()]
    svg = svg_of(events)
    for lane in svg.getElementsByTagName("g"):
        if lane.getAttribute("class") != "lane pod":
            continue
        [eviction], [exit_] = boxes(lane, "path", "evict"), boxes(lane, "rect", "exit")
        bars = [box for phase in ("serving", "draining", "terminating") for box in boxes(lane, "rect", phase)]
        assert not overlap(eviction, exit_)
        assert eviction[3] <= min(top for _, top, _, _ in bars), "the eviction's mark above the bar"
        assert exit_[1] >= max(bottom for *_, bottom in bars), "the engine's exit below the bar"


def test_pods_lost_with_the_instance_and_a_killed_agent_get_marks_of_their_own() -> None:
    events = [ev(10, Kind.NOTICE), ev(10.5, Kind.AGENT_KILLED), ev(30, Kind.DEADLINE)]
    events += [ev(30, Kind.RECLAIMED, pod) for pod in PODS]
    svg = svg_of(events)
    lost = [g for g in svg.getElementsByTagName("g") if g.getAttribute("class") == "reclaimed"]
    assert [g.parentNode.getAttribute("data-pod") for g in lost] == PODS  # type: ignore[union-attr]
    assert "marker agent" in {line.getAttribute("class") for line in svg.getElementsByTagName("line")}
    legend = render_html(result(events, STREAMS))
    assert "lost with the instance" in legend
    assert "node agent killed" in legend


def colours() -> dict[str, str]:
    """Each class the picture draws with, as its CSS colour (fill or stroke)."""
    found = {}
    for selector, colour in re.findall(r"([\w.]+) \{[^}]*?(?:fill|stroke): (#[0-9a-f]{6})", STYLE):
        found[selector.split(".")[-1] if "." in selector else selector] = colour
    return found


def test_the_deadline_and_every_marker_have_colours_of_their_own() -> None:
    used = colours()
    markers = ["notice", "node", "agent", "deadline"]
    assert len({used[m] for m in markers}) == len(markers)
    meanings = ["serving", "draining", "drained", "terminating", "cut"]
    assert {used[m] for m in markers}.isdisjoint(used[m] for m in meanings)
    assert used["deadline"] != used["cut"]


def test_refused_requests_are_not_numbered_as_streams() -> None:
    refused = StreamRecord(1, 3, None, 11.0, 11.0, 20, 0, Outcome.REFUSED)
    event = stream_event(refused)
    assert (event.kind, event.subject) == (Kind.REFUSED, "new request")
    assert "stream" not in event.text


def test_a_stream_the_gateway_continued_is_one_lane_that_changes_pod_at_each_splice() -> None:
    moved = StreamRecord(5, 1, "vllm-0", 2.0, 14.0, 200, 200, Outcome.COMPLETED, moves=((9.0, "spare-0"),))
    svg = xml.dom.minidom.parseString(timeline_svg(result([], [*STREAMS, moved]))).documentElement
    assert svg is not None
    [lane] = [g for g in svg.getElementsByTagName("g") if g.getAttribute("data-stream") == "5"]
    segments = [r for r in lane.getElementsByTagName("rect") if r.getAttribute("class") == "completed"]
    assert [text_of(r).split(",")[0] for r in segments] == ["stream 5 on vllm-0", "stream 5 on spare-0"]
    first, second = (float(r.getAttribute("x")) for r in segments)
    assert first + float(segments[0].getAttribute("width")) == pytest.approx(second, abs=0.2)
    [splice] = lane.getElementsByTagName("line")
    assert float(splice.getAttribute("x1")) == pytest.approx(second, abs=0.2)
    assert "vllm-0 → spare-0" in text_of(lane.getElementsByTagName("text")[0])


def test_a_stream_that_stayed_on_its_pod_is_one_segment_without_a_splice() -> None:
    svg = svg_of([])
    [lane] = [g for g in svg.getElementsByTagName("g") if g.getAttribute("data-stream") == "1"]
    assert len(lane.getElementsByTagName("rect")) == 1
    assert lane.getElementsByTagName("line") == []
