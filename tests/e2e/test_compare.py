"""``spotdrain simulate --compare``: every way of handling the notice played side by side on one node, pods and load.

The baselines' figures are whatever they measure; each test asserts only what follows from a way's mechanism. One
comparison (two pods with two streams each, a 13 s notice) serves every test of the file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from simulate.baselines import BY_NAME
from simulate.compare import Comparison, Played, compare, row
from simulate.compare_report import as_json, render, render_html
from simulate.report import render as render_run
from simulate.run import RunResult
from simulate.settings import SimulationSettings, Timings
from simulate.summary import Summary
from simulate.timeline import Event, Kind, Outcome

pytestmark = pytest.mark.e2e

SETTINGS = SimulationSettings("short-streams", 2, 2, 20.0, 1, Timings.scaled(13.0), compare=True)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compare")


@pytest.fixture(scope="module")
def comparison(workdir: Path) -> Iterator[Comparison]:
    played = asyncio.run(compare(SETTINGS, workdir=workdir))
    yield played
    for p in played.played:  # shown when a test fails
        print(f"\n== {p.way.name}: {p.skipped or ''}\n" + (render_run(p.result) if p.result else ""))


def result(c: Comparison, name: str) -> RunResult:
    found = next(p for p in c.played if p.way.name == name)
    if found.result is None:
        pytest.skip(f"{name} was skipped: {found.skipped}")
    return found.result


def events(r: RunResult, kind: Kind, pod: str) -> list[Event]:
    return [e for e in r.events if e.kind is kind and e.pod == pod]


def no_pod_out_before_its_eviction(s: Summary) -> bool:
    return all(p.evicted_at is not None and p.out_at is not None and p.out_at >= p.evicted_at for p in s.pods)


def test_spotdrain_cuts_no_stream_and_passes_its_own_verdict(comparison: Comparison) -> None:
    r = result(comparison, "spotdrain")
    assert r.passed
    assert comparison.passed
    assert r.summary.cut == 0
    assert r.summary.completed == r.summary.started > 0


def test_nth_style_cuts_every_stream_its_engines_had_open_when_evicted(comparison: Comparison) -> None:
    s = result(comparison, "nth-style").summary
    assert s.cordoned_at is not None
    assert s.tainted_at is None, "cordoned, not tainted: taintNode is false by default"
    assert s.evictions == len(s.pods)
    assert no_pod_out_before_its_eviction(s), "nothing flips readiness before the eviction"
    assert s.cut_by_engines is not None
    assert s.cut_by_engines > 0, "SIGTERM came while streams were open"
    assert s.cut == s.cut_by_engines, "the streams the engines aborted on SIGTERM are those the clients saw cut"
    assert not [e for e in result(comparison, "nth-style").events if e.kind is Kind.PRESTOP_RETURNED]


def test_the_published_seed_hook_fails_at_once_and_the_pods_go_as_without_one(
    comparison: Comparison, workdir: Path
) -> None:
    r = result(comparison, "seed-prestop")
    s = r.summary
    for pod in s.pods:
        (hook,) = events(r, Kind.PRESTOP_RETURNED, pod.name)
        assert hook.data["code"] not in (0, None), hook.text
        assert hook.data["seconds"] < 15 * SETTINGS.timings.scale, "it fails before its sleep 15 would end"
        assert not (workdir / "seed-prestop" / pod.name / "tmp" / "draining").exists(), "the touch never ran"
    assert no_pod_out_before_its_eviction(s)
    assert s.cut == s.cut_by_engines, "SIGTERM at once, as in nth-style"
    assert s.cut > 0


def test_the_fixed_seed_hook_holds_sigterm_until_its_engine_runs_nothing(comparison: Comparison) -> None:
    r = result(comparison, "seed-prestop-fixed")
    cap_s = (15 + 90) * SETTINGS.timings.scale
    for pod in r.summary.pods:
        for hook in events(r, Kind.PRESTOP_RETURNED, pod.name):
            assert hook.data["code"] == 0, hook.text
            assert hook.data["seconds"] >= 15 * SETTINGS.timings.scale, "it sleeps before polling"
            if hook.data["seconds"] < cap_s:  # it returned because the gauge read zero, not at its 90 s
                assert pod.cut_by_engine == 0, f"{pod.name}'s engine had streams open at SIGTERM"


def test_without_a_handler_the_pods_stay_to_the_deadline_and_only_it_cuts(comparison: Comparison) -> None:
    r = result(comparison, "none")
    s = r.summary
    assert s.evictions == 0
    assert s.cordoned_at is None
    assert s.reclaimed == len(s.pods), "every pod goes with the instance"
    assert s.deadline_at is not None
    assert all(p.out_at is None or p.out_at >= s.deadline_at for p in s.pods), "in rotation to the end"
    reclaimed_at = min(e.at for e in r.events if e.kind is Kind.RECLAIMED)
    cut = [st for st in r.streams if st.outcome is Outcome.CUT]
    assert cut, "streams were open when the instance went"
    assert all(st.ended >= reclaimed_at for st in cut), "nothing cuts a stream before the instance goes"


def test_spotdrain_takes_its_pods_out_of_rotation_no_later_than_any_other_way(comparison: Comparison) -> None:
    rows = {p.way.name: row(p) for p in comparison.played}
    ours = rows["spotdrain"]
    assert ours is not None
    assert ours.out_s is not None
    for name, other in rows.items():
        if other is not None and name != "spotdrain":
            assert other.out_s is None or ours.out_s <= other.out_s, name


def test_the_table_json_and_page_show_every_way_for_what_it_is(comparison: Comparison) -> None:
    text = render(comparison)
    for way in BY_NAME:
        assert f"| {way} |" in text
    assert "re-enactment of documented behaviour, not the other project's code" in text
    assert "played side by side in" in text
    document = json.loads(json.dumps(as_json(comparison)))
    assert [w["way"] for w in document["ways"]] == list(BY_NAME)
    assert document["passed"] is True
    page = render_html(comparison)
    assert 'class="comparison"' in page
    assert page.count('class="way"') == sum(p.result is not None for p in comparison.played)


async def test_a_way_whose_hook_needs_a_missing_command_is_skipped_with_its_reason_not_a_figure(
    tmp_path: Path,
) -> None:
    lacking = dataclasses.replace(BY_NAME["seed-prestop-fixed"], needs=("no-such-command-here",))
    played = await compare(SETTINGS, workdir=tmp_path, ways=(lacking,))
    assert played.played == (Played(lacking, None, played.played[0].skipped),)
    assert "no-such-command-here not installed" in str(played.played[0].skipped)
    assert row(played.played[0]) is None
    assert "skipped: no-such-command-here" in render(played)
    assert not played.passed, "no spotdrain run: nothing to pass"
