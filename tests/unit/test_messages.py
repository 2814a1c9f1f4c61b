"""Parsing SQS message bodies: every format AWS delivers, and no input that crashes the parser."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.notices.messages import Ignored, Invalid, LifecycleAction, Notices, Parsed, parse
from agent.notices.notice import Kind, Source

INSTANCE = "i-1234567890abcdef0"
TOKEN = "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6"
AT = datetime(2026, 11, 29, 10, 20, tzinfo=UTC)


def eventbridge(detail_type: str, detail: dict[str, Any], *, source: str = "aws.ec2", **extra: Any) -> dict[str, Any]:
    return {
        "version": "0",
        "id": "7bf73129-1428-4cd3-a780-95db273d1602",
        "detail-type": detail_type,
        "source": source,
        "account": "123456789012",
        "time": "2026-11-29T10:20:00Z",
        "region": "us-east-1",
        "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{INSTANCE}"],
        "detail": detail,
        **extra,
    }


SPOT = eventbridge("EC2 Spot Instance Interruption Warning", {"instance-id": INSTANCE, "instance-action": "terminate"})
REBALANCE = eventbridge("EC2 Instance Rebalance Recommendation", {"instance-id": INSTANCE})
STOPPING = eventbridge("EC2 Instance State-change Notification", {"instance-id": INSTANCE, "state": "stopping"})
HEALTH = eventbridge(
    "AWS Health Event",
    {
        "eventArn": "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/abc123",
        "service": "EC2",
        "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
        "eventTypeCategory": "scheduledChange",
        "statusCode": "upcoming",
        "startTime": "Sat, 05 Dec 2026 16:00:00 GMT",
        "eventDescription": [{"language": "en_US", "latestDescription": "The instance will be retired."}],
        "affectedEntities": [{"entityValue": INSTANCE}, {"entityValue": "i-0fedcba9876543210"}],
    },
    source="aws.health",
)
ASG_EVENT = eventbridge(
    "EC2 Instance-terminate Lifecycle Action",
    {
        "LifecycleActionToken": TOKEN,
        "AutoScalingGroupName": "gpu-nodes",
        "LifecycleHookName": "spotdrain",
        "EC2InstanceId": INSTANCE,
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
    },
    source="aws.autoscaling",
)
ASG_DIRECT = {
    "Origin": "AutoScalingGroup",
    "Destination": "EC2",
    "Service": "AWS Auto Scaling",
    "Time": "2026-11-29T10:20:00.185Z",
    "AccountId": "123456789012",
    "RequestId": "1d3f6e85-2d4b-4f69-9c3c-8e1d3a0b5f7e",
    "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
    "AutoScalingGroupName": "gpu-nodes",
    "EC2InstanceId": INSTANCE,
    "LifecycleActionToken": TOKEN,
    "LifecycleHookName": "spotdrain",
    "NotificationMetadata": "",
}
TEST_NOTIFICATION = {
    "AccountId": "123456789012",
    "RequestId": "5a1f7d5c-7d0b-4c1e-9b7e-2f1a1c3d4e5f",
    "AutoScalingGroupARN": "arn:aws:autoscaling:us-east-1:123456789012:autoScalingGroup:uuid:autoScalingGroupName/gpu",
    "AutoScalingGroupName": "gpu-nodes",
    "Service": "AWS Auto Scaling",
    "Event": "autoscaling:TEST_NOTIFICATION",
    "Time": "2026-11-29T10:20:00.185Z",
}
VALID = {"spot": SPOT, "rebalance": REBALANCE, "stopping": STOPPING, "health": HEALTH, "asg": ASG_EVENT}
VALID_WITH_DIRECT = {**VALID, "asg-direct": ASG_DIRECT}
INSTANCE_KEYS = {"spot": "instance-id", "rebalance": "instance-id", "stopping": "instance-id", "asg": "EC2InstanceId"}


def sns(message: dict[str, Any]) -> dict[str, Any]:
    return {
        "Type": "Notification",
        "MessageId": "22b80b92-fdea-4c2c-8f9d-bdfb0c7bf324",
        "TopicArn": "arn:aws:sns:us-east-1:123456789012:interruptions",
        "Message": json.dumps(message),
        "Timestamp": "2026-11-29T10:20:01.000Z",
        "SignatureVersion": "1",
    }


def notices(message: dict[str, Any], **kwargs: Any) -> Notices:
    parsed = parse(json.dumps(message), **kwargs)
    assert isinstance(parsed, Notices), parsed
    return parsed


def test_spot_warning_is_due_two_minutes_after_the_event() -> None:
    (notice,) = notices(SPOT).notices
    assert (notice.kind, notice.instance_id, notice.source) == (Kind.SPOT_INTERRUPTION, INSTANCE, Source.SQS)
    assert notice.deadline == AT + timedelta(seconds=120)
    assert notice.detail == "terminate"


def test_rebalance_recommendation_is_due_two_minutes_after_the_event() -> None:
    (notice,) = notices(REBALANCE).notices
    assert (notice.kind, notice.deadline) == (Kind.REBALANCE_RECOMMENDATION, AT + timedelta(seconds=120))


@pytest.mark.parametrize(
    ("state", "kind"),
    [
        ("stopping", Kind.INSTANCE_STOPPING),
        ("stopped", Kind.INSTANCE_STOPPING),
        ("shutting-down", Kind.INSTANCE_TERMINATING),
        ("terminated", Kind.INSTANCE_TERMINATING),
    ],
)
def test_state_change_is_due_at_the_event_time(state: str, kind: Kind) -> None:
    body = eventbridge("EC2 Instance State-change Notification", {"instance-id": INSTANCE, "state": state})
    (notice,) = notices(body).notices
    assert (notice.kind, notice.deadline) == (kind, AT)


@pytest.mark.parametrize("state", ["pending", "running"])
def test_state_change_to_a_running_state_is_ignored(state: str) -> None:
    body = eventbridge("EC2 Instance State-change Notification", {"instance-id": INSTANCE, "state": state})
    assert parse(json.dumps(body)) == Ignored(f"instance state {state!r}")


def test_health_scheduled_change_gives_one_notice_per_affected_instance_due_at_its_start() -> None:
    parsed = notices(HEALTH)
    assert [n.instance_id for n in parsed.notices] == [INSTANCE, "i-0fedcba9876543210"]
    assert {n.kind for n in parsed.notices} == {Kind.HEALTH_SCHEDULED_CHANGE}
    assert {n.deadline for n in parsed.notices} == {datetime(2026, 12, 5, 16, tzinfo=UTC)}
    assert parsed.lifecycle is None


@pytest.mark.parametrize(
    ("start", "deadline"),
    [
        ("2026-12-05T16:00:00Z", datetime(2026, 12, 5, 16, tzinfo=UTC)),
        ("Sat, 05 Dec 2026 17:00:00 +0100", datetime(2026, 12, 5, 16, tzinfo=UTC)),
        (None, AT),
    ],
)
def test_health_start_time_may_be_rfc3339_or_missing(start: str | None, deadline: datetime) -> None:
    body = copy.deepcopy(HEALTH)
    body["detail"]["startTime"] = start
    assert {n.deadline for n in notices(body).notices} == {deadline}


def test_health_start_time_that_is_no_date_makes_the_event_invalid() -> None:
    body = copy.deepcopy(HEALTH)
    body["detail"]["startTime"] = "next Tuesday"
    assert parse(json.dumps(body)) == Invalid("AWS Health startTime 'next Tuesday' is not a date")


@pytest.mark.parametrize(
    "change", [{"service": "RDS"}, {"eventTypeCategory": "issue"}, {"eventTypeCategory": "accountNotification"}]
)
def test_health_event_other_than_an_ec2_scheduled_change_is_ignored(change: dict[str, str]) -> None:
    body = copy.deepcopy(HEALTH)
    body["detail"].update(change)
    assert isinstance(parse(json.dumps(body)), Ignored)


def test_a_closed_health_event_withdraws_the_notices_of_the_open_one_under_their_ids() -> None:
    closed = copy.deepcopy(HEALTH)
    closed["id"] = "7bf73129-1428-4cd3-a780-95db273d1602"
    # Closing an event can also move its times: the eventArn is what names it.
    closed["detail"].update(statusCode="closed", startTime="Sun, 06 Dec 2026 08:00:00 GMT")
    closed["detail"]["endTime"] = "Sun, 06 Dec 2026 09:00:00 GMT"
    opened, withdrawn = notices(HEALTH).notices, notices(closed).notices
    assert [n.withdrawn for n in opened] == [False, False]
    assert [n.withdrawn for n in withdrawn] == [True, True]
    assert [n.id for n in withdrawn] == [n.id for n in opened]
    assert [n.instance_id for n in withdrawn] == [INSTANCE, "i-0fedcba9876543210"]


def test_a_closed_health_event_without_an_event_arn_names_nothing_to_withdraw() -> None:
    closed = copy.deepcopy(HEALTH)
    closed["detail"]["statusCode"] = "closed"
    del closed["detail"]["eventArn"]
    assert isinstance(parse(json.dumps(closed)), Ignored)


def test_health_entities_that_are_not_instances_are_skipped() -> None:
    body = copy.deepcopy(HEALTH)
    body["detail"]["affectedEntities"] = [{"entityValue": "vol-0123"}, {"entityValue": INSTANCE}, "junk"]
    assert [n.instance_id for n in notices(body).notices] == [INSTANCE]


def test_asg_lifecycle_event_names_the_action_to_complete_and_grants_the_budget() -> None:
    parsed = notices(ASG_EVENT, asg_budget_s=300)
    (notice,) = parsed.notices
    assert (notice.kind, notice.deadline) == (Kind.ASG_TERMINATION, AT + timedelta(seconds=300))
    assert parsed.lifecycle == LifecycleAction(
        hook_name="spotdrain", group_name="gpu-nodes", token=TOKEN, instance_id=INSTANCE
    )


def test_asg_hook_message_sent_straight_to_sqs_is_due_after_the_budget() -> None:
    parsed = notices(ASG_DIRECT)
    (notice,) = parsed.notices
    assert notice.deadline == AT + timedelta(seconds=120.185)
    assert parsed.lifecycle is not None
    assert parsed.lifecycle.token == TOKEN


@pytest.mark.parametrize(
    "body",
    [
        TEST_NOTIFICATION,
        {**ASG_DIRECT, "LifecycleTransition": "autoscaling:EC2_INSTANCE_LAUNCHING"},
        {**ASG_DIRECT, "LifecycleTransition": "autoscaling:TEST_NOTIFICATION"},
        eventbridge("EC2 Instance-launch Lifecycle Action", {"EC2InstanceId": INSTANCE}, source="aws.autoscaling"),
        {**sns({}), "Type": "SubscriptionConfirmation"},
    ],
    ids=["test-notification", "launching", "test-transition", "launch-event", "sns-subscription"],
)
def test_messages_that_ask_for_nothing_are_ignored(body: dict[str, Any]) -> None:
    assert isinstance(parse(json.dumps(body)), Ignored)


@pytest.mark.parametrize("name", VALID_WITH_DIRECT)
def test_sns_wrapped_message_parses_like_the_message_itself(name: str) -> None:
    body = VALID_WITH_DIRECT[name]
    assert parse(json.dumps(sns(body))) == parse(json.dumps(body))


@pytest.mark.parametrize("name", INSTANCE_KEYS)
def test_known_kind_without_its_instance_id_is_invalid(name: str) -> None:
    body = copy.deepcopy(VALID[name])
    del body["detail"][INSTANCE_KEYS[name]]
    parsed = parse(json.dumps(body))
    assert isinstance(parsed, Invalid)
    assert not parsed.unknown


def test_asg_message_without_its_token_is_invalid() -> None:
    body = {key: value for key, value in ASG_DIRECT.items() if key != "LifecycleActionToken"}
    assert parse(json.dumps(body)) == Invalid("lifecycle action lacks LifecycleActionToken")


def test_unknown_detail_type_is_invalid_and_marked_unknown() -> None:
    body = eventbridge("EC2 Fleet Error", {"sub-type": "spotFleetRequestConfigurationInvalid"})
    assert parse(json.dumps(body)) == Invalid("unknown detail-type 'EC2 Fleet Error'", unknown=True)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ("hello", "not JSON"),
        ("", "not JSON"),
        ("[1, 2]", "not a JSON object but list"),
        ('"text"', "not a JSON object but str"),
        ('{"Type": "Notification", "Message": "{"}', "SNS Message is not JSON"),
        ('{"Type": "Notification", "Message": 5}', "SNS Message is not a string"),
    ],
)
def test_body_that_is_not_a_json_object_is_invalid(body: str, reason: str) -> None:
    parsed = parse(body)
    assert isinstance(parsed, Invalid)
    assert parsed.reason.startswith(reason)


def test_object_of_no_known_shape_is_unknown() -> None:
    parsed = parse('{"hello": "world"}')
    assert isinstance(parsed, Invalid)
    assert parsed.unknown


@pytest.mark.parametrize("name", VALID_WITH_DIRECT)
def test_redelivered_message_gives_the_same_notice_ids(name: str) -> None:
    body = json.dumps(VALID_WITH_DIRECT[name])
    assert [n.id for n in notices(json.loads(body)).notices] == [n.id for n in notices(json.loads(body)).notices]


def test_two_events_for_one_instance_give_distinct_ids() -> None:
    second = {**REBALANCE, "id": "0b1ab2b5-1bb7-4ba0-97c2-7a2ab0b0d111"}
    assert notices(REBALANCE).notices[0].id != notices(second).notices[0].id


# Properties: whatever arrives, the parser answers with one of its three results.

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def check(parsed: Parsed) -> None:
    assert isinstance(parsed, Notices | Ignored | Invalid)
    if isinstance(parsed, Notices):
        assert parsed.notices
        assert all(notice.source is Source.SQS and notice.id for notice in parsed.notices)
        assert (parsed.lifecycle is not None) == (parsed.notices[0].kind is Kind.ASG_TERMINATION)
    else:
        assert parsed.reason


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key and index inside a JSON value, as paths from its root."""
    if isinstance(value, dict):
        items: list[tuple[Any, Any]] = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return []
    return [path for key, child in items for path in [(*prefix, key), *paths(child, (*prefix, key))]]


@given(st.text())
def test_no_text_crashes_the_parser(body: str) -> None:
    check(parse(body))


@given(JSON)
def test_no_json_value_crashes_the_parser(value: Any) -> None:
    check(parse(json.dumps(value)))
    check(parse(json.dumps({"Type": "Notification", "Message": json.dumps(value)})))


@settings(max_examples=300)
@given(st.sampled_from(sorted(VALID_WITH_DIRECT)), st.booleans(), st.data())
def test_no_mutation_of_a_valid_message_crashes_the_parser(name: str, wrapped: bool, data: st.DataObject) -> None:
    body = copy.deepcopy(VALID_WITH_DIRECT[name])
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        places = paths(body)
        if not places:
            break
        *parents, last = data.draw(st.sampled_from(places))
        container = body
        for key in parents:
            container = container[key]
        if data.draw(st.booleans()):
            del container[last]
        else:
            container[last] = data.draw(JSON)
    check(parse(json.dumps(sns(body) if wrapped else body)))
