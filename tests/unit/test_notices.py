from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.notices.notice import Kind, Notice, Source
from sidecar.notices import DEFINITIVE, NodeNotice, NoticeError, parse_notice

# Any JSON value, and objects shaped like a notice whose fields hold any JSON value or a likely string.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELD = st.sampled_from(["id", "kind", "deadline", "source"])
LIKELY = st.sampled_from([*sorted(DEFINITIVE), "rebalance-recommendation", "2026-11-29T10:22:00Z"]) | st.text()
NOTICE_LIKE = st.dictionaries(FIELD, LIKELY | JSON, max_size=4)


def test_no_content_is_no_notice() -> None:
    assert parse_notice(204, "") is None


def test_a_definitive_notice_carries_its_deadline() -> None:
    body = '{"id": "ab", "kind": "spot-interruption", "deadline": "2026-11-29T10:22:00Z", "source": "imds"}'
    notice = parse_notice(200, body)
    assert notice is not None
    assert notice.deadline == datetime(2026, 11, 29, 10, 22, tzinfo=UTC)


def test_a_rebalance_recommendation_does_not_drain() -> None:
    body = '{"id": "ab", "kind": "rebalance-recommendation", "deadline": "2026-11-29T10:22:00Z", "source": "sqs"}'
    assert parse_notice(200, body) is None


@pytest.mark.parametrize(
    ("status", "body"),
    [(500, ""), (200, "not json"), (200, "[]"), (200, '{"kind": "spot-interruption"}'), (200, '{"deadline": 3}')],
)
def test_answers_that_cannot_be_a_notice_are_errors(status: int, body: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - json and date errors are ValueErrors too
        parse_notice(status, body)


def test_the_sidecar_and_the_agent_agree_on_which_kinds_drain() -> None:
    assert {kind.value for kind in Kind if kind.definitive} == DEFINITIVE


def test_what_the_agent_publishes_the_sidecar_reads() -> None:
    notice = Notice(Kind.SPOT_INTERRUPTION, "i-0abc", datetime(2026, 11, 29, 10, 22, tzinfo=UTC), Source.IMDS)
    read = parse_notice(200, json.dumps(notice.public()))
    assert read is not None
    assert (read.id, read.kind, read.deadline) == (notice.id, "spot-interruption", notice.deadline)


@pytest.mark.parametrize(
    "deadline",
    ["0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-01:00", "2026-13-01T00:00:00Z", "\u0000", ""],
)
def test_a_deadline_no_datetime_can_hold_is_a_notice_error(deadline: str) -> None:
    body = json.dumps({"id": "ab", "kind": "spot-interruption", "deadline": deadline, "source": "imds"})
    with pytest.raises(NoticeError, match="deadline"):
        parse_notice(200, body)


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000])
def test_json_nested_deeper_than_the_parser_goes_is_a_notice_error(body: str) -> None:
    with pytest.raises(NoticeError, match="RecursionError"):
        parse_notice(200, body)


def test_fields_that_are_not_strings_are_never_rendered() -> None:
    body = {"id": [[[1]]], "kind": "spot-interruption", "deadline": "2026-11-29T10:22:00Z", "source": {"a": 1}}
    notice = parse_notice(200, json.dumps(body))
    assert notice is not None
    assert (notice.id, notice.source) == ("", "")


def _parse_or_reject(status: int, body: bytes | str) -> NodeNotice | None:
    try:
        return parse_notice(status, body)
    except NoticeError:
        return None


@given(st.integers(100, 599), st.binary(max_size=300))
def test_no_bytes_make_the_parser_raise_anything_but_notice_error(status: int, body: bytes) -> None:
    _parse_or_reject(status, body)


@given(JSON | NOTICE_LIKE)
def test_no_json_value_makes_the_parser_raise_anything_but_notice_error(value: object) -> None:
    notice = _parse_or_reject(200, json.dumps(value))
    if notice is not None:
        assert isinstance(value, dict)
        assert notice.kind in DEFINITIVE
        assert notice.kind == value["kind"]
        assert notice.deadline.tzinfo is not None
