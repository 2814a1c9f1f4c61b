"""IMDS answers as notices: one pure function per metadata path, from (status, body, now) to what it announces.

A 404 means "nothing scheduled". Any answer that is not what the IMDS documentation describes raises
``ImdsFormatError`` and nothing else, whatever the bytes: the poller counts it and polls again.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from agent.notices.notice import SPOT_WARNING, Kind, Notice, Source
from spotdrain.clock import parse_rfc3339

TOKEN = "/latest/api/token"
INSTANCE_ID = "/latest/meta-data/instance-id"
AVAILABILITY_ZONE = "/latest/meta-data/placement/availability-zone"
SPOT = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
MAINTENANCE = "/latest/meta-data/events/maintenance/scheduled"
LIFECYCLE = "/latest/meta-data/autoscaling/target-lifecycle-state"

# The paths polled for notices, in the order their notices are reported within one poll.
NOTICE_PATHS = (SPOT, REBALANCE, MAINTENANCE, LIFECYCLE)

ASG_BUDGET = timedelta(seconds=120)
SPOT_ACTIONS = frozenset({"terminate", "stop", "hibernate"})
MAINTENANCE_CODES = frozenset(
    {"system-reboot", "system-maintenance", "instance-reboot", "instance-retirement", "instance-stop"}
)
MAINTENANCE_ACTIVE = "active"
MAINTENANCE_WITHDRAWN = frozenset({"canceled", "completed"})

Body = str | bytes

_INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")
# ASCII only: int() and fromisoformat() would take other scripts' digits too.
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})?", re.ASCII)
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_GMT = re.compile(r"(\d{1,2}) (" + "|".join(_MONTHS) + r") (\d{4}) (\d{2}):(\d{2}):(\d{2}) GMT", re.ASCII)
_LIFECYCLE_STATE = re.compile(r"[A-Za-z]+(:[A-Za-z]+)?")
# AWS documents the IMDSv2 token as opaque; every real one is URL-safe base64 of 56 characters ("AQAEA...==").
# It goes into a header as it is, so an answer of another shape (a proxy's HTML page, a misrouted hop's JSON) is
# refused here rather than sent on: a newline in a header value makes aiohttp raise ValueError.
_TOKEN = re.compile(rb"[A-Za-z0-9+/_=-]{32,512}")


class ImdsFormatError(ValueError):
    """An IMDS answer that does not have the documented format."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def text_of(path: str, body: Body) -> str:
    """The body as text; IMDS answers in UTF-8."""
    if isinstance(body, str):
        return body
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ImdsFormatError(path, "body is not UTF-8") from None


def _json(path: str, body: Body) -> Any:
    text = text_of(path, body)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise ImdsFormatError(path, "body is not JSON") from None


def _checked(path: str, status: int) -> bool:
    """True when the answer carries a body to read, False for 404; other statuses are not IMDS's format."""
    if status == 404:
        return False
    if status != 200:
        raise ImdsFormatError(path, f"unexpected HTTP {status}")
    return True


def _field(path: str, data: Any, key: str) -> str:
    if not isinstance(data, dict):
        raise ImdsFormatError(path, "expected a JSON object")
    value = data.get(key)
    if not isinstance(value, str):
        raise ImdsFormatError(path, f"{key} is missing or not a string")
    return value


def parse_time(path: str, text: str) -> datetime:
    """RFC 3339 (spot, rebalance) or IMDS's maintenance format ``21 Jan 2019 09:00:43 GMT``, as UTC."""
    try:
        if _RFC3339.fullmatch(text):
            return parse_rfc3339(text)
        match = _GMT.fullmatch(text)
        if match:
            day, month, year, hour, minute, second = match.groups()
            numbers = (int(year), _MONTHS.index(month) + 1, int(day), int(hour), int(minute), int(second))
            return datetime(*numbers, tzinfo=UTC)
    except (ValueError, OverflowError):
        raise ImdsFormatError(path, f"{text!r} is not a valid time") from None
    raise ImdsFormatError(path, f"{text!r} is neither RFC 3339 nor 'DD Mon YYYY HH:MM:SS GMT'")


def parse_token(body: bytes) -> str:
    """The session token from a 200 answer to ``PUT /latest/api/token``; anything that is not one is refused."""
    token = body.strip()
    if not _TOKEN.fullmatch(token):
        raise ImdsFormatError(TOKEN, f"answered {len(body)} bytes that are not a session token: {body[:60]!r}")
    return token.decode("ascii")


def parse_instance_id(status: int, body: Body) -> str:
    """The instance id from ``meta-data/instance-id``; a 404 here is as wrong as garbage."""
    if not _checked(INSTANCE_ID, status):
        raise ImdsFormatError(INSTANCE_ID, "instance id not found")
    text = text_of(INSTANCE_ID, body).strip()
    if not _INSTANCE_ID.fullmatch(text):
        raise ImdsFormatError(INSTANCE_ID, f"{text[:40]!r} is not an instance id")
    return text


def parse_spot(status: int, body: Body, now: datetime, *, instance_id: str) -> Notice | None:
    """A spot interruption: the deadline is the announced ``time``, the action (stop, ...) is part of its identity."""
    if not _checked(SPOT, status):
        return None
    data = _json(SPOT, body)
    action = _field(SPOT, data, "action")
    if action not in SPOT_ACTIONS:
        raise ImdsFormatError(SPOT, f"unknown action {action[:40]!r}")
    deadline = parse_time(SPOT, _field(SPOT, data, "time"))
    return Notice(Kind.SPOT_INTERRUPTION, instance_id, deadline, Source.IMDS, detail=action)


def parse_rebalance(status: int, body: Body, now: datetime, *, instance_id: str) -> Notice | None:
    """A rebalance recommendation: the instance could get a two-minute warning at once, so that is its deadline."""
    if not _checked(REBALANCE, status):
        return None
    noticed = parse_time(REBALANCE, _field(REBALANCE, _json(REBALANCE, body), "noticeTime"))
    try:
        deadline = noticed + SPOT_WARNING
    except OverflowError:
        raise ImdsFormatError(REBALANCE, "noticeTime is out of range") from None
    return Notice(Kind.REBALANCE_RECOMMENDATION, instance_id, deadline, Source.IMDS)


def _maintenance_event(item: Any, *, instance_id: str) -> Notice:
    code = _field(MAINTENANCE, item, "Code")
    if code not in MAINTENANCE_CODES:
        raise ImdsFormatError(MAINTENANCE, f"unknown event code {code[:40]!r}")
    state = _field(MAINTENANCE, item, "State")
    if state != MAINTENANCE_ACTIVE and state not in MAINTENANCE_WITHDRAWN:
        raise ImdsFormatError(MAINTENANCE, f"unknown event state {state[:40]!r}")
    event_id = _field(MAINTENANCE, item, "EventId")
    if not event_id:
        raise ImdsFormatError(MAINTENANCE, "empty EventId")
    not_before = parse_time(MAINTENANCE, _field(MAINTENANCE, item, "NotBefore"))
    withdrawn = state in MAINTENANCE_WITHDRAWN
    return Notice(Kind.SCHEDULED_MAINTENANCE, instance_id, not_before, Source.IMDS, event_id, withdrawn=withdrawn)


def parse_maintenance(status: int, body: Body, now: datetime, *, instance_id: str) -> list[Notice]:
    """Scheduled events, one notice each; a canceled or completed event is a withdrawn notice with the same id."""
    if not _checked(MAINTENANCE, status):
        return []
    events = _json(MAINTENANCE, body)
    if not isinstance(events, list):
        raise ImdsFormatError(MAINTENANCE, "expected a JSON list")
    return [_maintenance_event(item, instance_id=instance_id) for item in events]


def parse_lifecycle(
    status: int, body: Body, now: datetime, *, instance_id: str, budget: timedelta = ASG_BUDGET
) -> Notice | None:
    """``Terminated`` is an ASG termination, due ``budget`` after ``now`` (when it was first seen); other states and
    404 (not in an Auto Scaling group) announce nothing."""
    if not _checked(LIFECYCLE, status):
        return None
    state = text_of(LIFECYCLE, body).strip()
    if not _LIFECYCLE_STATE.fullmatch(state):
        raise ImdsFormatError(LIFECYCLE, f"{state[:40]!r} is not a lifecycle state")
    if state != "Terminated":
        return None
    return Notice(Kind.ASG_TERMINATION, instance_id, now + budget, Source.IMDS, detail=state)


def parse(
    path: str, status: int, body: Body, now: datetime, *, instance_id: str, budget: timedelta = ASG_BUDGET
) -> list[Notice]:
    """Any of ``NOTICE_PATHS``, as the list of notices its answer announces."""
    if path == MAINTENANCE:
        return parse_maintenance(status, body, now, instance_id=instance_id)
    if path == SPOT:
        notice = parse_spot(status, body, now, instance_id=instance_id)
    elif path == REBALANCE:
        notice = parse_rebalance(status, body, now, instance_id=instance_id)
    elif path == LIFECYCLE:
        notice = parse_lifecycle(status, body, now, instance_id=instance_id, budget=budget)
    else:
        raise ValueError(f"{path} is not a notice path")
    return [] if notice is None else [notice]
