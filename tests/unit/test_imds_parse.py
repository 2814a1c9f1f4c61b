from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.notices.imds_parse import (
    INSTANCE_ID,
    LIFECYCLE,
    MAINTENANCE,
    MAINTENANCE_CODES,
    NOTICE_PATHS,
    REBALANCE,
    SPOT,
    ImdsFormatError,
    parse,
    parse_instance_id,
    parse_lifecycle,
    parse_maintenance,
    parse_rebalance,
    parse_spot,
    parse_time,
    parse_token,
)
from agent.notices.notice import Kind, Source
from simulate.fakes.imds import maintenance_time

INSTANCE = "i-0123456789abcdef0"
NOW = datetime(2026, 11, 29, 10, 20, 5, tzinfo=UTC)


def spot_body(action: str = "terminate", time: str = "2026-11-29T10:22:00Z") -> str:
    return json.dumps({"action": action, "time": time})


def event(**fields: str) -> dict[str, str]:
    base = {
        "Code": "system-reboot",
        "Description": "scheduled reboot",
        "EventId": "instance-event-0d59937288b749b32",
        "NotBefore": "21 Jan 2019 09:00:43 GMT",
        "NotAfter": "21 Jan 2019 09:17:23 GMT",
        "State": "active",
    }
    return base | fields


def maintenance(*events: dict[str, str]) -> str:
    return json.dumps(list(events))


def test_spot_notice_is_due_at_the_announced_time() -> None:
    notice = parse_spot(200, spot_body(), NOW, instance_id=INSTANCE)
    assert notice is not None
    assert notice.kind is Kind.SPOT_INTERRUPTION
    assert notice.source is Source.IMDS
    assert notice.instance_id == INSTANCE
    assert notice.deadline == datetime(2026, 11, 29, 10, 22, tzinfo=UTC)
    assert notice.detail == "terminate"


def test_repeated_polls_of_one_spot_answer_give_the_same_notice() -> None:
    first = parse_spot(200, spot_body().encode(), NOW, instance_id=INSTANCE)
    later = parse_spot(200, spot_body(), NOW + timedelta(seconds=30), instance_id=INSTANCE)
    assert first == later
    assert first is not None
    assert later is not None
    assert first.id == later.id


def test_a_changed_spot_action_is_a_new_notice() -> None:
    terminate = parse_spot(200, spot_body("terminate"), NOW, instance_id=INSTANCE)
    stop = parse_spot(200, spot_body("stop"), NOW, instance_id=INSTANCE)
    assert terminate is not None
    assert stop is not None
    assert stop.detail == "stop"
    assert terminate.id != stop.id


@pytest.mark.parametrize("path", [SPOT, REBALANCE, MAINTENANCE, LIFECYCLE])
def test_404_announces_nothing(path: str) -> None:
    assert parse(path, 404, "<html>Not Found</html>", NOW, instance_id=INSTANCE) == []


def test_rebalance_is_due_two_minutes_after_its_notice_time() -> None:
    notice = parse_rebalance(200, '{"noticeTime": "2026-11-29T10:20:00Z"}', NOW, instance_id=INSTANCE)
    assert notice is not None
    assert notice.kind is Kind.REBALANCE_RECOMMENDATION
    assert notice.deadline == datetime(2026, 11, 29, 10, 22, tzinfo=UTC)
    assert not notice.kind.definitive


@pytest.mark.parametrize("code", sorted(MAINTENANCE_CODES))
def test_every_maintenance_code_is_scheduled_maintenance_due_at_not_before(code: str) -> None:
    [notice] = parse_maintenance(200, maintenance(event(Code=code)), NOW, instance_id=INSTANCE)
    assert notice.kind is Kind.SCHEDULED_MAINTENANCE
    assert notice.deadline == datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)
    assert notice.detail == "instance-event-0d59937288b749b32"
    assert not notice.withdrawn


@pytest.mark.parametrize("state", ["canceled", "completed"])
def test_a_canceled_or_completed_event_is_withdrawn_under_the_same_id(state: str) -> None:
    [active] = parse_maintenance(200, maintenance(event()), NOW, instance_id=INSTANCE)
    [gone] = parse_maintenance(200, maintenance(event(State=state)), NOW, instance_id=INSTANCE)
    assert gone.withdrawn
    assert gone.id == active.id


def test_no_scheduled_events_is_an_empty_list() -> None:
    assert parse_maintenance(200, "[]", NOW, instance_id=INSTANCE) == []


def test_each_scheduled_event_is_its_own_notice() -> None:
    second = event(EventId="instance-event-0aaaaaaaaaaaaaaaa", NotBefore="2026-12-01T00:00:00Z")
    notices = parse_maintenance(200, maintenance(event(), second), NOW, instance_id=INSTANCE)
    assert [n.detail for n in notices] == ["instance-event-0d59937288b749b32", "instance-event-0aaaaaaaaaaaaaaaa"]
    assert notices[1].deadline == datetime(2026, 12, 1, tzinfo=UTC)


def test_lifecycle_terminated_is_due_a_budget_after_it_was_seen() -> None:
    notice = parse_lifecycle(200, "Terminated", NOW, instance_id=INSTANCE)
    assert notice is not None
    assert notice.kind is Kind.ASG_TERMINATION
    assert notice.deadline == NOW + timedelta(seconds=120)
    shorter = parse_lifecycle(200, "Terminated\n", NOW, instance_id=INSTANCE, budget=timedelta(seconds=30))
    assert shorter is not None
    assert shorter.deadline == NOW + timedelta(seconds=30)


@pytest.mark.parametrize("state", ["InService", "Standby", "Detached", "Warmed:Pending", "Pending:Wait"])
def test_other_lifecycle_states_announce_nothing(state: str) -> None:
    assert parse_lifecycle(200, state, NOW, instance_id=INSTANCE) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("21 Jan 2019 09:00:43 GMT", datetime(2019, 1, 21, 9, 0, 43, tzinfo=UTC)),
        ("1 Dec 2026 23:59:59 GMT", datetime(2026, 12, 1, 23, 59, 59, tzinfo=UTC)),
        ("2026-11-29T10:22:00Z", datetime(2026, 11, 29, 10, 22, tzinfo=UTC)),
        ("2026-11-29T12:22:00.5+02:00", datetime(2026, 11, 29, 10, 22, 0, 500000, tzinfo=UTC)),
    ],
)
def test_times_are_read_in_both_imds_formats(text: str, expected: datetime) -> None:
    assert parse_time(MAINTENANCE, text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "21 January 2019 09:00:43 GMT",
        "21 jan 2019 09:00:43 GMT",
        "21 Jan 2019 09:00:43",
        "21 Jan 2019 9:00:43 GMT",
        "21 Jan 2019 09:00:43 UTC",
        "Mon, 21 Jan 2019 09:00:43 GMT",
        "31 Feb 2019 09:00:43 GMT",
        "21 Jan 2019 24:00:00 GMT",
        "2019-01-21",
        "20190121T090043Z",
        "9999-12-31T23:59:59-01:00",
        "",
    ],
)
def test_times_in_any_other_shape_are_refused(text: str) -> None:
    with pytest.raises(ImdsFormatError):
        parse_time(MAINTENANCE, text)


@given(st.datetimes(min_value=datetime(1970, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)))
def test_the_fakes_maintenance_format_reads_back(moment: datetime) -> None:
    whole = moment.replace(microsecond=0)
    assert parse_time(MAINTENANCE, maintenance_time(whole)) == whole


@pytest.mark.parametrize(
    ("path", "body", "reason"),
    [
        (SPOT, "not json", "not JSON"),
        (SPOT, b"\xff\xfe", "UTF-8"),
        (SPOT, "[]", "JSON object"),
        (SPOT, "[" * 100_000 + "]" * 100_000, "not JSON"),
        (SPOT, '{"time": "2026-11-29T10:22:00Z"}', "action"),
        (SPOT, spot_body(action="reboot"), "unknown action"),
        (SPOT, spot_body(time="soon"), "soon"),
        (REBALANCE, '{"noticeTime": 5}', "noticeTime"),
        (REBALANCE, '{"noticeTime": "9999-12-31T23:59:00Z"}', "out of range"),
        (MAINTENANCE, "{}", "JSON list"),
        (MAINTENANCE, maintenance(event(Code="instance-hibernate")), "unknown event code"),
        (MAINTENANCE, maintenance(event(State="pending")), "unknown event state"),
        (MAINTENANCE, maintenance(event(EventId="")), "EventId"),
        (MAINTENANCE, json.dumps(["x"]), "JSON object"),
        (LIFECYCLE, "Terminated now", "lifecycle state"),
        (LIFECYCLE, "", "lifecycle state"),
    ],
)
def test_malformed_answers_raise_a_format_error_naming_the_path(path: str, body: str | bytes, reason: str) -> None:
    with pytest.raises(ImdsFormatError, match=reason) as raised:
        parse(path, 200, body, NOW, instance_id=INSTANCE)
    assert raised.value.path == path


@pytest.mark.parametrize("status", [400, 401, 500, 503])
def test_a_status_other_than_200_or_404_is_not_an_answer(status: int) -> None:
    with pytest.raises(ImdsFormatError, match=f"HTTP {status}"):
        parse(SPOT, status, spot_body(), NOW, instance_id=INSTANCE)


def test_instance_id_is_read_and_checked() -> None:
    assert parse_instance_id(200, b"i-0123456789abcdef0\n") == INSTANCE
    assert parse_instance_id(200, "i-1234abcd") == "i-1234abcd"
    bad: list[tuple[int, str | bytes]] = [(200, "<html>"), (200, "i-XYZ"), (404, "Not Found"), (200, b"\x80")]
    for status, body in bad:
        with pytest.raises(ImdsFormatError):
            parse_instance_id(status, body)


STATUSES = st.sampled_from([200, 200, 200, 404, 400, 500])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
NEAR_MISS = st.fixed_dictionaries(
    {},
    optional={
        key: JSON | st.sampled_from(["terminate", "stop", "active", "canceled", "2026-11-29T10:22:00Z", "x"])
        for key in ("action", "time", "noticeTime", "Code", "EventId", "NotBefore", "State")
    },
)


def _parses_or_refuses(path: str, status: int, body: str | bytes) -> None:
    try:
        notices = parse(path, status, body, NOW, instance_id=INSTANCE)
    except ImdsFormatError:
        return
    assert all(notice.instance_id == INSTANCE for notice in notices)


@given(path=st.sampled_from(NOTICE_PATHS), status=STATUSES, body=st.text() | st.binary())
def test_no_body_crashes_a_parser(path: str, status: int, body: str | bytes) -> None:
    _parses_or_refuses(path, status, body)


@given(path=st.sampled_from(NOTICE_PATHS), document=JSON | NEAR_MISS | st.lists(NEAR_MISS, max_size=3))
def test_no_json_document_crashes_a_parser(path: str, document: Any) -> None:
    _parses_or_refuses(path, 200, json.dumps(document))


@given(body=st.text() | st.binary(), status=STATUSES)
def test_no_body_crashes_the_instance_id_parser(body: str | bytes, status: int) -> None:
    try:
        instance_id = parse_instance_id(status, body)
    except ImdsFormatError as error:
        instance_id = error.path
    assert instance_id == INSTANCE_ID or instance_id.startswith("i-")


REAL_TOKEN = b"AQAEAHhnfPvJ6tOfXP9S-Km9tBmui0DU-JWBBTy_N6M5YhL8ly3Orw=="  # the shape IMDS answers: 56 characters


def test_a_session_token_is_taken_as_imds_sends_it() -> None:
    assert parse_token(REAL_TOKEN) == REAL_TOKEN.decode()
    assert parse_token(REAL_TOKEN + b"\n") == REAL_TOKEN.decode()


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html>\n<head><title>Sign in to the network</title></head>\n<body>...</body>\n</html>\n",
        b'{"error": "proxy authentication required"}',
        b"short",
        REAL_TOKEN[:20] + b"\n" + REAL_TOKEN[20:],
        REAL_TOKEN.replace(b"-", b"\xc3\xa9"),
        REAL_TOKEN * 20,
    ],
)
def test_anything_else_is_not_a_session_token(body: bytes) -> None:
    with pytest.raises(ImdsFormatError, match="not a session token"):
        parse_token(body)


@given(body=st.binary(max_size=600) | st.text(max_size=200).map(str.encode))
def test_whatever_answers_a_token_request_is_a_header_safe_token_or_refused(body: bytes) -> None:
    try:
        token = parse_token(body)
    except ImdsFormatError as error:
        shown = str(error)
    else:
        assert 32 <= len(token) <= 512
        assert token.isascii()
        assert token.isprintable()
        assert token == token.strip()
        return
    assert repr(body[:60]) in shown, "the error shows the start of what came back"
