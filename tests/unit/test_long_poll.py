"""The long poll's pure parts: the hold the agent grants, and when the sidecar asks again."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.drain.board import MAX_WAIT_S, wait_seconds
from sidecar.notices import Answer, next_pause, parse_answer, request_url

SPOT = {"id": "n-1", "kind": "spot-interruption", "deadline": "2099-01-01T00:00:00Z", "source": "imds"}


@pytest.mark.parametrize(("raw", "held"), [(None, 0), ("", 0), ("0", 0), ("0.5", 0.5), ("30", 30), ("3600", 60)])
def test_the_agent_holds_what_is_asked_up_to_its_cap(raw: str | None, held: float) -> None:
    assert wait_seconds(raw) == held


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf", "-inf", "1e999"])
def test_a_wait_that_is_no_duration_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match="is not a number of seconds"):
        wait_seconds(raw)


@given(st.text(max_size=20))
def test_any_wait_text_gives_a_hold_within_the_cap_or_a_value_error(raw: str) -> None:
    try:
        held = wait_seconds(raw)
    except ValueError:
        return
    assert 0 <= held <= MAX_WAIT_S


def test_an_answer_held_for_the_wait_is_followed_by_the_next_long_poll_at_once() -> None:
    assert next_pause(after=None, seen=None, held_s=30.0, wait_s=30, interval_s=0.5) == 0


def test_an_unchanged_answer_at_once_is_an_agent_ignoring_wait_and_is_polled_at_the_interval() -> None:
    assert next_pause(after=None, seen=None, held_s=0.002, wait_s=30, interval_s=0.5) == 0.5
    assert next_pause(after="r-1", seen="r-1", held_s=0.002, wait_s=30, interval_s=0.5) == 0.5


def test_a_changed_answer_is_followed_at_once_by_a_request_that_waits_on_it() -> None:
    assert next_pause(after=None, seen="r-1", held_s=0.002, wait_s=30, interval_s=0.5) == 0
    assert next_pause(after="r-1", seen=None, held_s=0.002, wait_s=30, interval_s=0.5) == 0


def test_without_a_wait_the_endpoint_is_polled_at_the_interval_whatever_it_answers() -> None:
    assert next_pause(after=None, seen="r-1", held_s=0.002, wait_s=0, interval_s=0.5) == 0.5


def test_the_request_keeps_the_node_it_names_and_adds_wait_and_after() -> None:
    url = request_url("http://10.0.0.1:8090/v1/notice?node=gpu-1", wait_s=30, after="r 1&x")
    assert url.path == "/v1/notice"
    assert dict(url.query) == {"node": "gpu-1", "wait": "30", "after": "r 1&x"}
    assert dict(request_url("http://h/v1/notice", wait_s=0.5, after=None).query) == {"wait": "0.5"}
    assert str(request_url("http://h/v1/notice", wait_s=0, after=None)) == "http://h/v1/notice"


def test_an_answer_names_the_notice_it_shows_whether_or_not_it_drains() -> None:
    assert parse_answer(204, b"") == Answer(seen=None, notice=None)
    spot = parse_answer(200, json.dumps(SPOT))
    assert spot.seen == "n-1"
    assert spot.notice is not None
    assert spot.notice.id == "n-1"
    rebalance = parse_answer(200, json.dumps({**SPOT, "id": "r-1", "kind": "rebalance-recommendation"}))
    assert (rebalance.seen, rebalance.notice) == ("r-1", None)
    assert parse_answer(200, json.dumps({**SPOT, "id": 7})).seen is None
