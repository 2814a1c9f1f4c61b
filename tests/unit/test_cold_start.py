"""The cold-start scenario's pure parts: its verdict from recorded events, the check of a model's copy against its
source, the node's models annotation, and the byte ranges the fake servers read."""

from __future__ import annotations

import pytest

from simulate.fakes.ranges import Unsatisfiable, byte_range
from simulate.model import Expected, copy_problems, expected, tiny_checkpoint
from simulate.page import render_html
from simulate.replacement import models_of
from simulate.report import render
from simulate.run import RunResult
from simulate.scenarios import SCENARIOS, judge
from simulate.settings import SimulationSettings, Timings
from simulate.summary import Summary, summarize
from simulate.timeline import Event, Kind
from tests.unit.test_simulation import MARKED_ONCE, PODS, STREAMS, drained_node, ev

STEPS = "notice, node, fetch, model, engine, pod, first token in order"
WHOLE = "the model on the replacement's cache is whole and identical to the source"
AFTER = "the engine started only once the fetch had returned 0"
TOKEN = "the replacement served a first token"


def replaced(
    *, model_ready: float = 17.0, engine: float = 17.3, problems: tuple[str, ...] = (), code: int = 0
) -> list[Event]:
    """The drained node of test_simulation (notice at 10 s), and a replacement joining at 15 s."""
    events = [
        *drained_node(),
        ev(15.0, Kind.NODE_JOINED),
        ev(15.5, Kind.CACHE_READY),
        ev(15.9, Kind.FETCH_STARTED, "vllm-new"),
        ev(17.5, Kind.POD_READY, "vllm-new"),
        ev(17.6, Kind.FIRST_TOKEN, "vllm-new"),
    ]
    if code == 0:
        events.append(ev(model_ready, Kind.MODEL_READY, "vllm-new", code=0, files=4, problems=list(problems)))
        events.append(ev(engine, Kind.ENGINE_STARTED, "vllm-new", files=4))
    else:
        events.append(ev(model_ready, Kind.FETCH_FAILED, "vllm-new", code=code))
    return events


def summary_of(events: list[Event]) -> Summary:
    return summarize(events, STREAMS, pods=PODS, facts=MARKED_ONCE)


def checks(events: list[Event]) -> dict[str, bool]:
    return {c.name: c.passed for c in judge(SCENARIOS["cold-start"], summary_of(events))}


def test_a_replacement_that_hydrates_then_starts_its_engine_then_serves_passes() -> None:
    verdict = checks(replaced())
    assert all(verdict.values()), verdict
    c = summary_of(replaced()).cold_start
    assert c is not None
    assert (c.joined_at, c.model_ready_at, c.fetch_code, c.first_token_pod) == (15.0, 17.0, 0, "vllm-new")


def test_an_engine_started_before_the_fetch_returned_fails_the_order_and_the_engine_check() -> None:
    verdict = checks(replaced(model_ready=17.2, engine=16.5))
    assert verdict[AFTER] is False
    assert verdict[STEPS] is False
    assert verdict[WHOLE] is True


def test_a_model_that_differs_from_its_source_fails_only_its_check() -> None:
    verdict = checks(replaced(problems=("model-00002-of-00002.safetensors: 10 bytes, the source has 1310720",)))
    assert [name for name, passed in verdict.items() if not passed] == [WHOLE]


def test_a_failed_fetch_fails_the_model_check_and_the_missing_steps_are_named() -> None:
    events = [e for e in replaced(code=1) if e.kind not in (Kind.POD_READY, Kind.FIRST_TOKEN)]
    summary = summary_of(events)
    by_name = {c.name: c for c in judge(SCENARIOS["cold-start"], summary)}
    assert by_name[WHOLE].detail == "fetch exited 1"
    assert by_name[STEPS].detail == "no model ready"
    assert by_name[TOKEN].passed is False
    assert by_name[AFTER].passed is True, "the engine did not start on an incomplete model"


def test_a_first_token_from_a_drained_pod_is_not_the_replacements() -> None:
    events = [e for e in replaced() if e.kind is not Kind.FIRST_TOKEN] + [ev(17.6, Kind.FIRST_TOKEN, "vllm-0")]
    assert checks(events)[TOKEN] is False


def test_without_a_replacement_the_scenario_fails_and_other_scenarios_have_none() -> None:
    assert checks(drained_node())["a replacement node joined"] is False
    assert summary_of(drained_node()).cold_start is None


def test_the_report_gives_the_replacements_steps_after_the_notice_and_the_page_draws() -> None:
    events = replaced()
    summary = summary_of(events)
    settings = SimulationSettings("cold-start", len(PODS), 2, 20.0, 1, Timings.scaled(20))
    result = RunResult(
        SCENARIOS["cold-start"],
        settings,
        "2026-11-29T10:22:00Z",
        tuple(sorted(events, key=lambda e: e.at)),
        tuple(STREAMS),
        summary,
        judge(SCENARIOS["cold-start"], summary),
    )
    text = render(result)
    assert "joined 5.00 s, model ready 7.00 s (fetch 1.10 s), first token 7.60 s after the notice" in text
    assert "replacement node joined +5.00 s -> model fetch started +0.90 s -> model ready +1.10 s" in text
    assert render_html(result).startswith("<!DOCTYPE html>")


def test_a_copy_is_checked_file_by_file_and_against_its_manifest() -> None:
    files = tiny_checkpoint()
    assert files == tiny_checkpoint(), "the same bytes every run"
    source = expected(files)
    manifest = {
        "files": [
            {"path": path, "size": want.size, "checksum": {"kind": "crc64nvme", "value": want.crc64nvme}}
            for path, want in source.items()
        ]
    }
    assert copy_problems(source, dict(source), manifest) == []
    damaged = dict(source)
    damaged["config.json"] = Expected(source["config.json"].size, "0" * 32)
    del damaged["tokenizer.json"]
    damaged["extra.bin"] = Expected(1, "1" * 32)
    assert copy_problems(source, damaged, manifest) == [
        "tokenizer.json: missing",
        "extra.bin: not in the source",
        f"config.json: MD5 {'0' * 32}, the source's is {source['config.json'].md5}",
    ]
    unchecked = {"files": [{**entry, "checksum": None} for entry in manifest["files"]]}
    assert copy_problems(source, dict(source), unchecked)[0] == (
        ".spotdrain-manifest.json: config.json checked against none None, not the source's"
    )
    short = {"files": manifest["files"][:1]}
    assert copy_problems(source, dict(source), short)[0].startswith(".spotdrain-manifest.json: lists")
    assert copy_problems(source, dict(source), None) == [".spotdrain-manifest.json: missing or without files"]


def test_the_models_annotation_names_each_model_and_its_source() -> None:
    assert models_of("llama=s3://models/llama/, mistral = hf+https://m/hub/org/mistral") == {
        "llama": "s3://models/llama/",
        "mistral": "hf+https://m/hub/org/mistral",
    }
    assert models_of("") == {}
    assert models_of("no-source=,=s3://x/") == {}


@pytest.mark.parametrize(
    ("header", "wanted"),
    [
        ("bytes=0-9", (0, 9)),
        ("bytes=90-", (90, 99)),
        ("bytes=95-500", (95, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=-500", (0, 99)),
        (None, None),
        ("bytes=0-1,5-6", None),  # several ranges: the whole body, as S3 does
        ("items=0-1", None),
    ],
)
def test_a_range_header_is_read_as_rfc_9110_writes_it(header: str | None, wanted: tuple[int, int] | None) -> None:
    assert byte_range(header, 100) == wanted


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=-0", "bytes=9-3"])
def test_a_range_outside_the_body_is_unsatisfiable(header: str) -> None:
    with pytest.raises(Unsatisfiable):
        byte_range(header, 100)
