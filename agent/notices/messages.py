"""What an SQS message body says, as data: the notices it carries, or why it carries none. No I/O, never raises.

Bodies understood (any of them may also arrive wrapped in an SNS envelope, ``{"Type": "Notification", "Message":
"<json string>"}``):

- EventBridge envelopes ``{version, id, detail-type, source, account, time, region, resources, detail}`` for
  ``EC2 Spot Instance Interruption Warning``, ``EC2 Instance Rebalance Recommendation``,
  ``EC2 Instance State-change Notification``, ``AWS Health Event`` (EC2 scheduled changes) and
  ``EC2 Instance-terminate Lifecycle Action``. The ``source`` is not checked: events put for testing cannot use the
  reserved ``aws.*`` sources.
- Auto Scaling lifecycle hook messages sent straight to the queue (``LifecycleTransition``, ``LifecycleActionToken``,
  ``Time``...), and the ``autoscaling:TEST_NOTIFICATION`` a hook sends when it is created.

``Ignored`` is a message that is understood and asks for nothing (a test notification, an instance launching or
running); ``Invalid`` is one that cannot be used, with ``unknown`` set when it is not a kind of message known here.
A closed Health event withdraws the notices its open one gave: the same eventArn gives the same ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from agent.notices.notice import SPOT_WARNING, Kind, Notice, Source
from spotdrain.clock import parse_rfc3339

TERMINATING = "autoscaling:EC2_INSTANCE_TERMINATING"
LAUNCHING = "autoscaling:EC2_INSTANCE_LAUNCHING"
TEST_NOTIFICATION = "autoscaling:TEST_NOTIFICATION"
LIFECYCLE_KEYS = ("LifecycleHookName", "AutoScalingGroupName", "LifecycleActionToken")
STOPPING_STATES = frozenset({"stopping", "stopped"})
TERMINATING_STATES = frozenset({"shutting-down", "terminated"})
INSTANCE_ID = re.compile(r"i-[0-9a-z]{1,32}")
# Outside these years a timestamp is garbage, and adding a deadline to it could overflow datetime.
PLAUSIBLE_YEARS = range(1970, 9000)
DETAIL_TYPES = frozenset(
    {
        "EC2 Spot Instance Interruption Warning",
        "EC2 Instance Rebalance Recommendation",
        "EC2 Instance State-change Notification",
        "AWS Health Event",
        "EC2 Instance-terminate Lifecycle Action",
        "EC2 Instance-launch Lifecycle Action",
    }
)

Fields = dict[str, Any]


@dataclass(frozen=True)
class LifecycleAction:
    """Names the Auto Scaling lifecycle action to complete once the node is drained."""

    hook_name: str
    group_name: str
    token: str
    instance_id: str


@dataclass(frozen=True)
class Notices:
    notices: tuple[Notice, ...]
    lifecycle: LifecycleAction | None = None


@dataclass(frozen=True)
class Ignored:
    reason: str


@dataclass(frozen=True)
class Invalid:
    reason: str
    unknown: bool = False  # not a kind of message known here, rather than a known kind that is broken


Parsed = Notices | Ignored | Invalid


@dataclass(frozen=True)
class _Event:
    """The parts of an EventBridge envelope every detail-type needs."""

    detail_type: str
    id: str
    time: datetime
    detail: Fields


def parse(body: str, *, asg_budget_s: float = 120) -> Parsed:
    """Read one SQS message body; ``asg_budget_s`` is the drain time granted after an ASG lifecycle event."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as error:
        return Invalid(f"not JSON: {str(error)[:80]}")
    if not isinstance(data, dict):
        return Invalid(f"not a JSON object but {type(data).__name__}")
    if "Type" in data and "Message" in data:
        return _sns(data, asg_budget_s=asg_budget_s)
    return _message(data, asg_budget_s=asg_budget_s)


def _sns(data: Fields, *, asg_budget_s: float) -> Parsed:
    kind, message = data["Type"], data["Message"]
    if kind in ("SubscriptionConfirmation", "UnsubscribeConfirmation"):
        return Ignored(f"SNS {kind}")
    if kind != "Notification":
        return Invalid(f"unknown SNS message type {_shown(kind)}", unknown=True)
    if not isinstance(message, str):
        return Invalid("SNS Message is not a string")
    try:
        inner = json.loads(message)
    except (ValueError, RecursionError) as error:
        return Invalid(f"SNS Message is not JSON: {str(error)[:80]}")
    if not isinstance(inner, dict):
        return Invalid(f"SNS Message is not a JSON object but {type(inner).__name__}")
    return _message(inner, asg_budget_s=asg_budget_s)


def _message(data: Fields, *, asg_budget_s: float) -> Parsed:
    if "detail-type" in data:
        return _eventbridge(data, asg_budget_s=asg_budget_s)
    if "LifecycleTransition" in data:
        return _lifecycle(data, at=_time(data.get("Time")), asg_budget_s=asg_budget_s)
    event = data.get("Event")
    if event == TEST_NOTIFICATION:
        return Ignored("Auto Scaling test notification")
    if isinstance(event, str) and event.startswith("autoscaling:"):
        return Ignored(f"Auto Scaling notification {event}")
    return Invalid("unknown message: no detail-type, LifecycleTransition or autoscaling Event", unknown=True)


def _eventbridge(data: Fields, *, asg_budget_s: float) -> Parsed:
    detail_type = data["detail-type"]
    if not isinstance(detail_type, str) or detail_type not in DETAIL_TYPES:
        return Invalid(f"unknown detail-type {_shown(detail_type)}", unknown=True)
    detail, at, event_id = data.get("detail"), _time(data.get("time")), data.get("id")
    if not isinstance(detail, dict):
        return Invalid(f"{detail_type!r} has no detail object")
    if at is None:
        return Invalid(f"{detail_type!r} has no valid time")
    event = _Event(detail_type=detail_type, id=event_id if isinstance(event_id, str) else "", time=at, detail=detail)
    match detail_type:
        case "EC2 Spot Instance Interruption Warning":
            return _spot(event)
        case "EC2 Instance Rebalance Recommendation":
            return _rebalance(event)
        case "EC2 Instance State-change Notification":
            return _state_change(event)
        case "AWS Health Event":
            return _health(event)
        case "EC2 Instance-terminate Lifecycle Action":
            return _lifecycle(detail, at=at, asg_budget_s=asg_budget_s)
        case _:
            return Ignored("Auto Scaling launch lifecycle action")


def _spot(event: _Event) -> Parsed:
    instance = _instance_id(event.detail.get("instance-id"))
    if instance is None:
        return _lacks_instance(event.detail_type)
    # The action is part of the notice's identity (as on IMDS); an interruption is never lost over a missing one.
    action = _text(event.detail.get("instance-action")) or "terminate"
    return _notices(Kind.SPOT_INTERRUPTION, (instance,), event.time + SPOT_WARNING, detail=action)


def _rebalance(event: _Event) -> Parsed:
    instance = _instance_id(event.detail.get("instance-id"))
    if instance is None:
        return _lacks_instance(event.detail_type)
    return _notices(Kind.REBALANCE_RECOMMENDATION, (instance,), event.time + SPOT_WARNING, detail=event.id)


def _state_change(event: _Event) -> Parsed:
    state = event.detail.get("state")
    if not isinstance(state, str):
        return Invalid(f"{event.detail_type!r} has no state")
    if state in STOPPING_STATES:
        kind = Kind.INSTANCE_STOPPING
    elif state in TERMINATING_STATES:
        kind = Kind.INSTANCE_TERMINATING
    else:
        return Ignored(f"instance state {_shown(state)}")
    instance = _instance_id(event.detail.get("instance-id"))
    if instance is None:
        return _lacks_instance(event.detail_type)
    return _notices(kind, (instance,), event.time, detail=event.id)


def _health(event: _Event) -> Parsed:
    detail = event.detail
    service, category = detail.get("service"), detail.get("eventTypeCategory")
    if service != "EC2" or category != "scheduledChange":
        return Ignored(f"AWS Health {_shown(category)} event for service {_shown(service)}")
    # statusCode is upcoming, open or closed; a closed change is over or was cancelled, and what it marked is undone.
    closed = detail.get("statusCode") == "closed"
    arn = _text(detail.get("eventArn"))
    if closed and arn is None:
        return Ignored("closed AWS Health event without an eventArn: it names no notice to withdraw")
    instances = _affected_instances(detail.get("affectedEntities"))
    if not instances:
        return _lacks_instance(event.detail_type)
    start = detail.get("startTime")
    deadline = event.time if start is None else _health_time(start)
    if deadline is None:
        return Invalid(f"AWS Health startTime {_shown(start)} is not a date")
    # One scheduled change keeps its eventArn through its updates and its closing: the notices keep their ids.
    detail_id = arn or event.id
    return _notices(Kind.HEALTH_SCHEDULED_CHANGE, instances, deadline, detail=detail_id, withdrawn=closed)


def _lifecycle(fields: Fields, *, at: datetime | None, asg_budget_s: float) -> Parsed:
    transition = fields.get("LifecycleTransition")
    if transition == TEST_NOTIFICATION or fields.get("Event") == TEST_NOTIFICATION:
        return Ignored("Auto Scaling test notification")
    if transition == LAUNCHING:
        return Ignored("Auto Scaling launch lifecycle action")
    if transition != TERMINATING:
        return Invalid(f"unknown LifecycleTransition {_shown(transition)}", unknown=True)
    instance = _instance_id(fields.get("EC2InstanceId"))
    if instance is None:
        return Invalid("lifecycle action lacks EC2InstanceId")
    hook, group, token = (_text(fields.get(key)) for key in LIFECYCLE_KEYS)
    if hook is None or group is None or token is None:
        missing = ", ".join(key for key in LIFECYCLE_KEYS if _text(fields.get(key)) is None)
        return Invalid(f"lifecycle action lacks {missing}")
    if at is None:
        return Invalid("lifecycle action has no valid time")
    action = LifecycleAction(hook_name=hook, group_name=group, token=token, instance_id=instance)
    deadline = at + timedelta(seconds=asg_budget_s)
    # The token names one lifecycle action, whichever way (EventBridge or the hook itself) it was delivered.
    return replace(_notices(Kind.ASG_TERMINATION, (instance,), deadline, detail=action.token), lifecycle=action)


def _notices(
    kind: Kind, instances: tuple[str, ...], deadline: datetime, *, detail: str, withdrawn: bool = False
) -> Notices:
    return Notices(
        tuple(
            Notice(kind, instance, deadline, Source.SQS, detail=detail, withdrawn=withdrawn) for instance in instances
        )
    )


def _affected_instances(entities: object) -> tuple[str, ...]:
    """The instance ids among a Health event's affected entities (others can be volumes or hosts), each once."""
    if not isinstance(entities, list):
        return ()
    values = (entity.get("entityValue") for entity in entities if isinstance(entity, dict))
    ids = (_instance_id(value) for value in values)
    return tuple(dict.fromkeys(instance for instance in ids if instance is not None))


def _lacks_instance(detail_type: str) -> Invalid:
    return Invalid(f"{detail_type!r} lacks an instance id")


def _shown(value: object) -> str:
    """A value from a message, for a reason string: quoted, and short whatever the message held."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _instance_id(value: object) -> str | None:
    return value if isinstance(value, str) and INSTANCE_ID.fullmatch(value) else None


def _time(value: object) -> datetime | None:
    """An RFC 3339 timestamp, in UTC, or None."""
    if not isinstance(value, str):
        return None
    try:
        return _plausible(parse_rfc3339(value))
    except (ValueError, OverflowError):
        return None


def _health_time(value: object) -> datetime | None:
    """AWS Health writes ``Sat, 05 Jun 2021 16:00:00 GMT``; RFC 3339 is taken too."""
    if not isinstance(value, str):
        return None
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return _time(value)
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment
    try:
        return _plausible(moment.astimezone(UTC))
    except OverflowError:
        return None


def _plausible(moment: datetime) -> datetime | None:
    return moment if moment.year in PLAUSIBLE_YEARS else None
