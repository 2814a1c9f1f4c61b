from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from agent.notices.notice import Kind, Notice, Source
from sidecar.notices import DEFINITIVE, parse_notice


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
