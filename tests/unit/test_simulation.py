"""The simulation's pure parts: from recorded events to a summary, a verdict, and the text, JSON and HTML reports."""

from __future__ import annotations

import argparse
import json
import re
import xml.dom.minidom
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.draining import ENGINE_EXIT_MARGIN
from simulate import cli, run
from simulate.load import Line, parse_line
from simulate.observe import agent_note, gateway_note, node_marks, sidecar_note
from simulate.page import render_html
from simulate.report import as_json, render
from simulate.run import RunResult
from simulate.scenarios import SCENARIOS, judge
from simulate.settings import ENGINE_EXIT_MARGIN_S, SimulationSettings, Timings, add_arguments, from_arguments
from simulate.summary import Facts, summarize
from simulate.timeline import Event, Kind, Outcome, Recorder, StreamRecord, stream_event
from spotdrain.settings import SettingsError

PODS = ["vllm-0", "vllm-1"]
MARKED_ONCE = Facts(node_patches=1, node_events=1, rerouted=0)


def ev(at: float, kind: Kind, pod: str | None = None, **data: object) -> Event:
    return Event(at, kind, pod or "node", kind.value, pod=pod, data=data)


def stream(id: int, pod: str | None, started: float, ended: float, outcome: Outcome) -> StreamRecord:
    received = 0 if outcome is Outcome.REFUSED else (20 if outcome is Outcome.COMPLETED else 5)
    return StreamRecord(id, id, pod, started, ended, 20, received, outcome)


def drained_node(
    *, out: Sequence[float] = (10.2, 10.3), evicted: Sequence[float] = (11.0, 12.0), cut: Sequence[int] = (0, 0)
) -> list[Event]:
    """Notice at 10 s, deadline at 30 s; each pod out, evicted, drained (its sidecar reporting ``cut``), gone."""
    events = [ev(1, Kind.LOAD_STARTED), ev(10, Kind.NOTICE), ev(10.1, Kind.TAINTED), ev(10.1, Kind.CORDONED)]
    for pod, out_at, evicted_at, reported in zip(PODS, out, evicted, cut, strict=True):
        events += [
            ev(out_at, Kind.OUT_OF_ROTATION, pod),
            ev(evicted_at, Kind.EVICTED, pod, grace_s=17),
            ev(evicted_at + 0.4, Kind.DRAINED, pod, streams_cut=reported),
            ev(evicted_at + 0.6, Kind.ENGINE_EXITED, pod, code=0, cut=0),
            ev(evicted_at + 0.6, Kind.POD_REMOVED, pod),
        ]
    return [*events, ev(12.8, Kind.NODE_DRAINED), ev(30, Kind.DEADLINE)]


STREAMS = [
    stream(1, "vllm-0", 2.0, 10.5, Outcome.COMPLETED),
    stream(2, "vllm-1", 2.0, 11.2, Outcome.COMPLETED),
    stream(3, "vllm-0", 10.1, 11.4, Outcome.COMPLETED),
    stream(4, None, 11.5, 11.5, Outcome.REFUSED),
]


def verdict(
    scenario: str, events: list[Event], streams: Sequence[StreamRecord] | None = None, facts: Facts = MARKED_ONCE
) -> dict[str, bool]:
    """Each check of ``scenario`` by name: passed or not."""
    summary = summarize(events, STREAMS if streams is None else streams, pods=PODS, facts=facts)
    return {c.name: c.passed for c in judge(SCENARIOS[scenario], summary)}


def failed(scenario: str, events: list[Event], *, facts: Facts = MARKED_ONCE) -> list[str]:
    return [name for name, passed in verdict(scenario, events, facts=facts).items() if not passed]


def test_the_summary_times_each_pod_from_the_notice_and_its_last_stream() -> None:
    s = summarize(drained_node(), STREAMS, pods=PODS, facts=MARKED_ONCE)
    assert (s.started, s.completed, s.cut, s.refused) == (3, 3, 0, 1)
    assert [p.notice_to_out_s for p in s.pods] == [0.2, 0.3]
    assert s.notice_to_out_max_s == 0.3
    # vllm-0's last stream ended at 11.4 s and its engine exited at 11.6 s; vllm-1's at 11.2 s and 12.6 s.
    assert [p.last_stream_to_exit_s for p in s.pods] == [0.2, 1.4]
    assert s.all_gone_at == 12.6
    assert s.spare_s == 17.4
    assert all(p.out_before_eviction for p in s.pods)


def test_a_pod_still_in_rotation_when_evicted_fails_short_streams() -> None:
    assert failed("short-streams", drained_node(out=(10.2, 12.5))) == ["out of rotation before eviction"]


def test_a_clean_drain_passes_short_streams_and_one_cut_stream_fails_it() -> None:
    assert failed("short-streams", drained_node()) == []
    cut = [*STREAMS, stream(5, "vllm-1", 3.0, 12.1, Outcome.CUT)]
    checks = verdict("short-streams", drained_node(cut=(0, 1)), cut)
    assert checks["no stream cut"] is False
    assert checks["cut streams reported = cut streams seen"] is True


def test_long_streams_fail_when_the_sidecars_report_fewer_cuts_than_the_clients_saw() -> None:
    cut = [*STREAMS, stream(5, "vllm-1", 3.0, 14.1, Outcome.CUT), stream(6, "vllm-0", 3.0, 14.1, Outcome.CUT)]
    checks = verdict("long-streams", drained_node(), cut)
    assert checks["long streams are cut at the deadline"] is True
    assert checks["cut streams reported = cut streams seen"] is False


def test_through_the_gateway_a_cut_the_sidecars_reported_must_have_been_continued() -> None:
    events = drained_node(cut=(1, 0))
    summary = summarize(events, STREAMS, pods=PODS, facts=MARKED_ONCE)
    checks = {c.name: c.passed for c in judge(SCENARIOS["long-streams"], summary, gateway=True)}
    assert checks["no stream cut"] is True
    assert checks["every stream the sidecars cut was continued"] is False
    continued = [*events, ev(12.0, Kind.CONTINUED)]
    summary = summarize(continued, STREAMS, pods=PODS, facts=MARKED_ONCE)
    assert all(c.passed for c in judge(SCENARIOS["long-streams"], summary, gateway=True))


def test_the_gateways_continuations_go_on_the_timeline() -> None:
    note = gateway_note({"event": "gateway.continued", "cause": "reset", "tokens_sent": 12})
    assert note is not None
    assert note.kind is Kind.CONTINUED
    assert "12 tokens" in note.text
    assert gateway_note({"event": "gateway.cut", "reason": "limit"}) is None


def test_pdb_blocks_passes_only_when_the_refusals_are_retried_given_up_and_the_pods_reclaimed() -> None:
    events = [ev(10, Kind.NOTICE), ev(30, Kind.DEADLINE)]
    for pod in PODS:
        events += [ev(10.3, Kind.OUT_OF_ROTATION, pod), ev(10.8, Kind.DRAINED, pod, streams_cut=0)]
        events += [ev(11 + i, Kind.EVICTION_BLOCKED, pod) for i in range(3)]
        events += [ev(28, Kind.EVICTION_FAILED, pod), ev(30, Kind.RECLAIMED, pod), ev(30, Kind.POD_REMOVED, pod)]
    summary = summarize(events, STREAMS, pods=PODS, facts=MARKED_ONCE)
    assert (summary.eviction_refusals, summary.evictions_given_up, summary.reclaimed) == (6, 2, 2)
    assert failed("pdb-blocks", events) == []
    unblocked = [e for e in events if e.kind is not Kind.EVICTION_BLOCKED]
    assert failed("pdb-blocks", unblocked) == ["429s from the budget retried"]


def test_agent_restart_fails_when_the_node_was_patched_twice() -> None:
    events = [*drained_node(), ev(0.5, Kind.AGENT_STARTED), ev(10.2, Kind.AGENT_KILLED), ev(10.6, Kind.AGENT_STARTED)]
    events.append(ev(10.6, Kind.ALREADY_MARKED))
    assert failed("agent-restart", events) == []
    twice = Facts(node_patches=2, node_events=2, rerouted=0)
    assert failed("agent-restart", events, facts=twice) == ["node marked once"]


def test_sqs_fails_while_the_message_is_still_in_the_queue() -> None:
    kept = Facts(node_patches=1, node_events=1, rerouted=0, message_deleted=False)
    assert failed("sqs", drained_node(), facts=kept) == ["message deleted"]


def test_the_recorder_times_events_from_its_start_and_hands_each_to_its_sink() -> None:
    ticks = iter([100.0, 101.5, 103.0])
    seen: list[Event] = []
    recorder = Recorder(lambda: next(ticks), sink=seen.append)
    recorder.record(Kind.NOTICE, "imds", "notice")
    recorder.stream(stream(1, "vllm-0", 0.5, 3.0, Outcome.CUT))
    assert [(e.at, e.kind) for e in seen] == [(1.5, Kind.NOTICE), (3.0, Kind.STREAM_CUT)]
    assert "CUT on vllm-0 after 5 of 20 tokens" in seen[1].text


def test_timings_keep_the_sidecars_fixed_exit_margin_and_scale_the_rest() -> None:
    assert ENGINE_EXIT_MARGIN.total_seconds() == ENGINE_EXIT_MARGIN_S
    t = Timings.scaled(20)
    assert t.window_s == 10
    assert t.grace_s == 30
    assert 0.3 <= t.endpoint_delay_s < 1
    assert Timings.scaled(120).endpoint_delay_s == 5.0


def test_a_notice_too_short_for_the_sidecars_margin_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SettingsError, match="at least 12"):
        from_arguments(parser.parse_args(["--notice-seconds", "10"]))
    assert from_arguments(parser.parse_args(["--scenario", "sqs"])).timings.notice_s == 20


def test_every_scenario_can_be_chosen_with_the_flag() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for name in SCENARIOS:
        assert from_arguments(parser.parse_args(["--scenario", name])).scenario == name


def test_compare_is_refused_where_the_other_ways_have_nothing_to_play() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for refused in (["--scenario", "node-lost"], ["--scenario", "agent-restart"], ["--gateway"]):
        with pytest.raises(SettingsError, match="--compare"):
            from_arguments(parser.parse_args(["--compare", *refused]))
    assert from_arguments(parser.parse_args(["--compare", "--scenario", "pdb-blocks"])).compare


def test_log_events_become_timeline_notes() -> None:
    blocked = agent_note({"event": "pod.eviction_blocked", "pod": "vllm-1", "error": "HTTP 429", "retry_in_s": 2.0})
    assert blocked is not None
    assert (blocked.kind, blocked.pod) == (Kind.EVICTION_BLOCKED, "vllm-1")
    assert agent_note({"event": "pod.evicted", "pod": "vllm-1"}) is None  # the fake API reports evictions itself
    drained = sidecar_note({"event": "drain.timeout", "outcome": "timeout", "streams_cut": 3}, pod="vllm-0")
    assert drained is not None
    assert drained.data == {"outcome": "timeout", "streams_cut": 3}
    taint = {"key": "spotdrain.io/interruption", "value": "spot-interruption", "effect": "NoSchedule"}
    assert set(node_marks({"spec": {"taints": [taint], "unschedulable": True}})) == {Kind.TAINTED, Kind.CORDONED}
    assert node_marks({"spec": {"taints": [{"key": "nvidia.com/gpu"}]}}) == {}


KEYS = ("choices", "token_ids", "finish_reason", "text", "usage", "x")


def test_a_stream_line_counts_tokens_and_the_end() -> None:
    assert parse_line(b'data: {"choices":[{"text":" t1"}]}\n') == Line(1)
    assert parse_line(b'data: {"choices":[{"text":"","token_ids":[7]}]}\n') == Line(1)  # a held-back byte
    assert parse_line(b'data: {"choices":[{"text":"\xc3\xa9","token_ids":[7, 8]}]}\n') == Line(2)
    assert parse_line(b'data: {"choices":[{"text":"x","finish_reason":"stop"}]}\n') == Line(1, finish="stop")
    assert parse_line(b'data: {"choices":[],"usage":{}}\n') == Line()
    assert parse_line(b"data: [DONE]\n") == Line(done=True)
    assert parse_line(b"\n") == Line()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=12,
)


@given(st.binary(max_size=200) | JSON.map(lambda value: b"data: " + json.dumps(value).encode()))
def test_no_line_crashes_the_stream_parser(raw: bytes) -> None:
    line = parse_line(raw)
    assert line.tokens >= 0
    assert isinstance(line.done, bool)


def result(events: list[Event], streams: list[StreamRecord], scenario: str = "short-streams") -> RunResult:
    settings = SimulationSettings(scenario, len(PODS), 2, 20.0, 1, Timings.scaled(20))
    summary = summarize(events, streams, pods=PODS, facts=MARKED_ONCE)
    return RunResult(
        SCENARIOS[scenario],
        settings,
        "2026-11-29T10:22:00Z",
        tuple(sorted(events, key=lambda e: e.at)),
        tuple(streams),
        summary,
        judge(SCENARIOS[scenario], summary),
    )


def test_the_text_report_hides_load_before_the_notice_and_ends_with_the_verdict() -> None:
    early = stream(9, "vllm-0", 1.0, 4.0, Outcome.COMPLETED)
    late = stream(3, "vllm-0", 10.1, 11.4, Outcome.COMPLETED)
    events = [*drained_node(), stream_event(early), stream_event(late)]
    text = render(result(events, [*STREAMS, early]))
    assert text.splitlines()[0] == "spotdrain simulate: short-streams"
    assert "stream 9" not in text
    assert "stream 3" in text
    assert text.index("notice") < text.index("verdict: PASS (short-streams)")
    assert re.search(r"notice to out of rotation\s+max 0.30 s", text)


def test_the_json_result_holds_the_verdict_events_and_streams() -> None:
    data = json.loads(json.dumps(as_json(result(drained_node(), STREAMS))))
    assert data["passed"] is True
    assert data["summary"]["cut"] == 0
    assert {c["name"] for c in data["checks"]} >= {"no stream cut", "out of rotation before eviction"}
    assert [s["outcome"] for s in data["streams"]] == ["completed", "completed", "completed", "refused"]
    assert data["settings"]["timings"]["notice_s"] == 20


def test_the_page_has_one_lane_per_pod_and_per_stream_and_no_external_asset() -> None:
    page = render_html(result(drained_node(), STREAMS))
    assert page.count('class="lane pod"') == len(PODS)
    assert page.count('class="lane stream"') == 3  # the refused request never became a stream
    assert re.findall(r"(?:src|href)=", page) == []
    assert re.findall(r"https?://", page) == ["http://"]  # the SVG namespace only
    svg = re.search(r"<svg.*</svg>", page, re.S)
    assert svg is not None
    xml.dom.minidom.parseString(svg.group(0))  # well-formed, as a browser's SVG parser needs


def test_a_failed_verdict_makes_the_command_exit_non_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    failed = result(drained_node(out=(10.2, 12.5)), STREAMS)

    async def fake_simulate(settings: SimulationSettings, **_: object) -> RunResult:
        return failed

    monkeypatch.setattr(run, "simulate", fake_simulate)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--log-dir", str(tmp_path), "--html", str(tmp_path / "run.html")])
    assert cli.main(args) == 1
    assert (tmp_path / "run.html").read_text().startswith("<!DOCTYPE html>")


def test_a_pod_drained_before_its_eviction_is_drawn_waiting_for_it() -> None:
    waited = [
        e if e.kind is not Kind.DRAINED else ev(e.at - 0.8, Kind.DRAINED, e.pod, streams_cut=0) for e in drained_node()
    ]
    assert 'class="drained"' in render_html(result(waited, STREAMS))
    assert 'class="drained"' not in render_html(result(drained_node(), STREAMS))
