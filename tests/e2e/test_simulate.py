"""``spotdrain simulate``, every scenario: the real sidecars and node agent against the fakes, judged on the verdict.

Time is compressed to a 13 s notice (3 s to drain after the sidecars' fixed 10 s margin) and two pods with two
streams each, so the whole file stays well inside a minute and a half on two cores.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from simulate.model import copy_problems, expected, read_copy, tiny_checkpoint
from simulate.page import render_html
from simulate.report import render
from simulate.run import RunResult, simulate
from simulate.settings import SimulationSettings, Timings
from simulate.timeline import Kind

pytestmark = pytest.mark.e2e

NOTICE_S = 13.0


async def play(scenario: str, workdir: Path, *, gateway: bool = False) -> RunResult:
    settings = SimulationSettings(scenario, 2, 2, 20.0, 1, Timings.scaled(NOTICE_S), gateway=gateway)
    result = await simulate(settings, workdir=workdir)
    print(render(result))  # shown when a test fails
    return result


async def test_short_streams_are_never_cut_and_every_pod_leaves_rotation_before_its_eviction(tmp_path: Path) -> None:
    result = await play("short-streams", tmp_path)
    s = result.summary
    assert result.passed
    assert s.started >= 4
    assert s.cut == s.cut_reported == s.cut_by_engines == 0
    assert s.completed == s.started
    assert [p.out_before_eviction for p in s.pods] == [True, True]
    assert s.notice_to_out_max_s is not None
    assert s.notice_to_out_max_s < 1.5
    assert s.refused > 0, "once no pod is in rotation the router refuses new requests"


async def test_long_streams_are_cut_and_the_sidecars_report_as_many_as_the_clients_saw(tmp_path: Path) -> None:
    result = await play("long-streams", tmp_path)
    s = result.summary
    assert result.passed
    assert s.cut > 0
    assert s.cut_reported == s.cut == s.cut_by_engines
    assert s.completed > 0


async def test_each_of_vllms_sigterm_endings_is_a_cut_stream_counted_and_a_hung_engine_is_killed(
    tmp_path: Path,
) -> None:
    result = await play("sigterm-endings", tmp_path)
    s = result.summary
    assert result.passed, [c for c in result.checks if not c.passed]
    aborting, failing, hung = s.pods
    assert aborting.cut > 0
    assert failing.cut > 0
    assert hung.cut > 0
    assert s.cut == s.cut_reported
    assert aborting.cut_by_engine == aborting.cut
    assert failing.cut_by_engine == failing.cut
    assert hung.cut_by_engine is None, "the hung engine was killed: it could not count"
    kills = [e.pod for e in result.events if e.kind.value == "killed"]
    assert kills == [hung.name]


async def test_the_shipped_budget_lets_both_unready_pods_of_the_node_be_evicted(tmp_path: Path) -> None:
    result = await play("shipped-budget", tmp_path)
    s = result.summary
    assert result.passed
    assert [p.ready_when_evicted for p in s.pods] == [False, False]
    assert (s.evictions, s.evictions_given_up, s.reclaimed) == (2, 0, 0)
    assert s.cut == 0


async def test_through_the_gateway_the_long_streams_continue_on_the_second_node_and_none_is_cut(
    tmp_path: Path,
) -> None:
    result = await play("long-streams", tmp_path, gateway=True)
    s = result.summary
    assert result.passed
    assert s.cut == 0
    assert s.cut_reported > 0, "the drained pods still cut their long streams"
    assert s.continued >= s.cut_reported
    assert s.completed == s.started
    moved = [r for r in result.streams if r.moves]
    assert moved, "a continued stream is recorded with the pod it moved to"
    for record in moved:
        pods = [record.pod, *(pod for _, pod in record.moves)]
        assert all(a != b for a, b in itertools.pairwise(pods))
        assert all(record.started <= at <= record.ended for at, _ in record.moves)
    assert 'class="splice"' in render_html(result)


async def test_a_lost_node_cuts_its_open_streams_and_through_the_gateway_none(tmp_path: Path) -> None:
    for name in ("without", "through"):
        (tmp_path / name).mkdir()
    without = await play("node-lost", tmp_path / "without")
    assert without.passed
    assert without.summary.cut > 0, "nothing on a node killed outright saves its streams"
    through = await play("node-lost", tmp_path / "through", gateway=True)
    assert through.passed
    assert through.summary.cut == 0
    assert through.summary.continued > 0


async def test_a_blocking_budget_is_retried_until_the_deadline_and_the_pods_go_with_the_instance(
    tmp_path: Path,
) -> None:
    result = await play("pdb-blocks", tmp_path)
    s = result.summary
    assert result.passed
    assert s.eviction_refusals >= 4
    assert s.evictions == 0
    assert s.reclaimed == 2
    assert s.cut == 0, "the notice drained the pods though no eviction went through"


async def test_an_agent_killed_mid_drain_resumes_without_marking_the_node_twice(tmp_path: Path) -> None:
    result = await play("agent-restart", tmp_path)
    s = result.summary
    assert result.passed
    assert (s.agent_restarts, s.node_patches, s.node_events) == (1, 1, 1)
    assert s.already_marked
    assert s.evictions == 2
    assert s.cut == 0


async def test_a_notice_through_sqs_drains_the_node_and_the_message_is_deleted(tmp_path: Path) -> None:
    result = await play("sqs", tmp_path)
    s = result.summary
    assert result.passed
    assert s.message_deleted is True
    assert s.cordoned_at is not None
    assert s.cut == 0


async def test_a_replacement_node_hydrates_its_model_from_s3_before_its_engine_serves_a_first_token(
    tmp_path: Path,
) -> None:
    result = await play("cold-start", tmp_path)
    assert result.passed, [c for c in result.checks if not c.passed]
    c = result.summary.cold_start
    assert c is not None
    assert (c.fetch_code, c.model_files, c.engine_files, c.first_token_pod) == (0, 4, 4, "vllm-new")
    assert c.model_ready_at is not None
    assert c.fetch_started_at is not None
    assert c.model_ready_at - c.fetch_started_at > 1.0, "the bucket's rate makes the hydration take visible time"
    found, manifest = read_copy(tmp_path / "gpu-2" / "model-cache" / "models" / "llama-tiny")
    assert copy_problems(expected(tiny_checkpoint()), found, manifest) == []
    assert result.summary.cut == 0
    order = [Kind.NOTICE, Kind.NODE_JOINED, Kind.FETCH_STARTED, Kind.MODEL_READY, Kind.ENGINE_STARTED, Kind.FIRST_TOKEN]
    assert [e.kind for e in result.events if e.kind in order] == order
    assert '"event": "cache.fetched"' in (tmp_path / "vllm-new-init.log").read_text()


def test_the_command_prints_the_result_as_json_and_draws_the_page(tmp_path: Path) -> None:
    page = tmp_path / "run.html"
    flags = ["--pods", "1", "--streams-per-pod", "2", "--notice-seconds", "12", "--json", "--html", str(page)]
    done = subprocess.run(
        [sys.executable, "-m", "spotdrain.cli", "simulate", *flags, "--log-dir", str(tmp_path / "logs")],
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert result["passed"] is True
    assert result["scenario"] == "short-streams"
    assert page.read_text().count('class="lane pod"') == 1
    assert (tmp_path / "logs" / "node-agent.log").exists()
