"""The SQS source against moto's server: messages received, acknowledged, retried and dropped as AWS would see it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import pytest
from structlog.testing import capture_logs

from agent.notices.notice import Kind, Notice
from agent.notices.sqs import SqsMetrics, SqsSource
from simulate.fakes.aws import REGION, MotoServer
from simulate.fakes.events import eventbridge
from spotdrain.metrics import CollectorRegistry

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

INSTANCE = "i-0123456789abcdef0"
TOKEN = "0befcbdb-6ecd-498a-9ff7-ae9b54447cd6"
MakeSource = Callable[..., SqsSource]


def event(detail_type: str, detail: dict[str, Any], *, source: str = "aws.ec2") -> dict[str, Any]:
    return eventbridge(detail_type, detail, time="2026-11-29T10:20:00Z", region=REGION, source=source)


def sns(message: dict[str, Any]) -> dict[str, Any]:
    return {"Type": "Notification", "MessageId": str(uuid.uuid4()), "Message": json.dumps(message)}


def spot(instance: str = INSTANCE) -> dict[str, Any]:
    return event("EC2 Spot Instance Interruption Warning", {"instance-id": instance, "instance-action": "terminate"})


LIFECYCLE = {
    "LifecycleActionToken": TOKEN,
    "AutoScalingGroupName": "gpu-nodes",
    "LifecycleHookName": "spotdrain",
    "EC2InstanceId": INSTANCE,
    "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
}
ASG_DIRECT = {**LIFECYCLE, "Service": "AWS Auto Scaling", "Time": "2026-11-29T10:20:00.185Z", "RequestId": "r-1"}
HEALTH = event(
    "AWS Health Event",
    {
        "eventArn": "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/abc",
        "service": "EC2",
        "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
        "eventTypeCategory": "scheduledChange",
        "startTime": "Sat, 05 Dec 2026 16:00:00 GMT",
        "affectedEntities": [{"entityValue": INSTANCE}, {"entityValue": "i-0fedcba9876543210"}],
    },
    source="aws.health",
)
KINDS = {
    "spot": (spot(), Kind.SPOT_INTERRUPTION),
    "rebalance": (
        event("EC2 Instance Rebalance Recommendation", {"instance-id": INSTANCE}),
        Kind.REBALANCE_RECOMMENDATION,
    ),
    "stopping": (
        event("EC2 Instance State-change Notification", {"instance-id": INSTANCE, "state": "stopping"}),
        Kind.INSTANCE_STOPPING,
    ),
    "terminated": (
        event("EC2 Instance State-change Notification", {"instance-id": INSTANCE, "state": "terminated"}),
        Kind.INSTANCE_TERMINATING,
    ),
    "asg-event": (
        event("EC2 Instance-terminate Lifecycle Action", LIFECYCLE, source="aws.autoscaling"),
        Kind.ASG_TERMINATION,
    ),
    "asg-direct": (ASG_DIRECT, Kind.ASG_TERMINATION),
    "sns-spot": (sns(spot()), Kind.SPOT_INTERRUPTION),
    "sns-asg-direct": (sns(ASG_DIRECT), Kind.ASG_TERMINATION),
}


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def make_source(moto: MotoServer, queue: str, registry: CollectorRegistry) -> MakeSource:
    def make(**options: Any) -> SqsSource:
        settings: dict[str, Any] = {"wait_time_s": 1, "retry_delay_s": 0, "backoff_s": (0.01, 0.02, 0.05), **options}
        return SqsSource(
            queue_url=queue,
            region=REGION,
            endpoint_url=moto.endpoint_url,
            metrics=SqsMetrics.create(registry),
            **settings,
        )

    return make


def send(sqs: SQSClient, queue: str, body: dict[str, Any] | str) -> None:
    sqs.send_message(QueueUrl=queue, MessageBody=body if isinstance(body, str) else json.dumps(body))


def held(sqs: SQSClient, queue: str) -> tuple[int, int]:
    """Messages in the queue: (visible, received and not yet visible again); (0, 0) once all were deleted."""
    answer = sqs.get_queue_attributes(
        QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )
    attributes = answer["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]), int(attributes["ApproximateNumberOfMessagesNotVisible"])


def counted(registry: CollectorRegistry, outcome: str) -> float | None:
    return registry.get_sample_value("spotdrain_sqs_messages_total", {"outcome": outcome})


async def next_notice(stream: AsyncIterator[Notice]) -> Notice:
    async with asyncio.timeout(5):
        return await anext(stream)


def ack(notice: Notice) -> Any:
    assert notice.ack is not None
    return notice.ack


@pytest.mark.parametrize("name", KINDS)
async def test_every_kind_is_yielded_and_its_message_deleted_once_it_succeeded(
    name: str, moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource, registry: CollectorRegistry
) -> None:
    body, kind = KINDS[name]
    send(sqs, queue, body)
    async with aclosing(make_source().notices()) as stream:
        notice = await next_notice(stream)
        assert (notice.kind, notice.instance_id) == (kind, INSTANCE)
        assert held(sqs, queue) == (0, 1)
        await ack(notice).succeeded()
        await ack(notice).succeeded()  # a second answer changes nothing
    assert held(sqs, queue) == (0, 0)
    assert len(moto.calls("DeleteMessage", QueueUrl=queue)) == 1
    assert counted(registry, "handled") == 1
    completions = moto.calls("CompleteLifecycleAction", LifecycleActionToken=TOKEN, InstanceId=INSTANCE)
    if kind is Kind.ASG_TERMINATION:
        assert [c.params["LifecycleActionResult"] for c in completions][-1:] == ["CONTINUE"]
        assert completions[-1].params["LifecycleHookName"] == "spotdrain"
        assert completions[-1].params["AutoScalingGroupName"] == "gpu-nodes"
        assert moto.requests.index(completions[-1]) < moto.requests.index(
            moto.calls("DeleteMessage", QueueUrl=queue)[0]
        )


async def test_lifecycle_message_stays_when_completing_the_action_fails(
    moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource, registry: CollectorRegistry
) -> None:
    moto.fail("CompleteLifecycleAction", status=400, code="ValidationError")
    send(sqs, queue, ASG_DIRECT)
    async with aclosing(make_source(retry_delay_s=30).notices()) as stream:
        await ack(await next_notice(stream)).succeeded()
    assert moto.calls("DeleteMessage", QueueUrl=queue) == []
    assert held(sqs, queue) == (0, 1)
    assert counted(registry, "retried") == 1


async def test_completing_the_action_is_retried_after_a_server_error(
    moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource, registry: CollectorRegistry
) -> None:
    moto.fail("CompleteLifecycleAction", status=500, code="InternalFailure")
    send(sqs, queue, sns(ASG_DIRECT))
    async with aclosing(make_source().notices()) as stream:
        await ack(await next_notice(stream)).succeeded()
    assert held(sqs, queue) == (0, 0)
    assert registry.get_sample_value("spotdrain_sqs_errors_total", {"kind": "server"}) == 1


async def test_health_event_is_deleted_once_every_instance_succeeded(
    sqs: SQSClient, queue: str, make_source: MakeSource
) -> None:
    send(sqs, queue, HEALTH)
    async with aclosing(make_source().notices()) as stream:
        first, second = await next_notice(stream), await next_notice(stream)
        assert {first.instance_id, second.instance_id} == {INSTANCE, "i-0fedcba9876543210"}
        await ack(second).succeeded()
        assert held(sqs, queue) == (0, 1)
        await ack(first).succeeded()
    assert held(sqs, queue) == (0, 0)


@pytest.mark.parametrize(
    ("body", "outcome", "logged"),
    [
        ("{not json", "dropped-invalid", "sqs.dropped"),
        (
            json.dumps({"detail-type": "EC2 Instance Rebalance Recommendation", "detail": {}}),
            "dropped-invalid",
            "sqs.dropped",
        ),
        (json.dumps(event("EC2 Fleet Error", {})), "dropped-unknown", "sqs.dropped"),
        (
            json.dumps({"Event": "autoscaling:TEST_NOTIFICATION", "Service": "AWS Auto Scaling"}),
            "dropped-ignored",
            "sqs.ignored",
        ),
    ],
    ids=["not-json", "no-instance", "unknown", "test-notification"],
)
async def test_message_without_notices_is_deleted_counted_and_logged(
    body: str,
    outcome: str,
    logged: str,
    sqs: SQSClient,
    queue: str,
    make_source: MakeSource,
    registry: CollectorRegistry,
) -> None:
    send(sqs, queue, body)
    send(sqs, queue, spot())
    with capture_logs() as logs:
        async with aclosing(make_source().notices()) as stream:
            await ack(await next_notice(stream)).succeeded()
    assert held(sqs, queue) == (0, 0)
    assert counted(registry, outcome) == 1
    assert [entry["reason"] for entry in logs if entry["event"] == logged]


async def test_unknown_instance_is_retried_then_dropped_after_max_receives(
    moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource, registry: CollectorRegistry
) -> None:
    send(sqs, queue, spot())
    with capture_logs() as logs:
        async with aclosing(make_source(max_receives=3).notices()) as stream:
            for _ in range(3):
                await ack(await next_notice(stream)).retry("instance is not in this cluster")
    assert held(sqs, queue) == (0, 0)
    assert (counted(registry, "retried"), counted(registry, "dropped-unmatched")) == (2, 1)
    assert len(moto.calls("ChangeMessageVisibility", QueueUrl=queue, VisibilityTimeout=0)) == 2
    assert [entry["receives"] for entry in logs if entry["event"] == "sqs.gave_up"] == [3]


async def test_heartbeat_keeps_the_message_hidden_and_the_lifecycle_action_alive(
    moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource
) -> None:
    send(sqs, queue, ASG_DIRECT)
    async with aclosing(make_source(visibility_timeout_s=1).notices()) as stream:
        notice = await next_notice(stream)
        await asyncio.sleep(0.6)
        await ack(notice).heartbeat()
        await asyncio.sleep(0.6)  # past the first second the message was hidden for
        assert held(sqs, queue) == (0, 1)
    assert moto.calls("RecordLifecycleActionHeartbeat", LifecycleActionToken=TOKEN, LifecycleHookName="spotdrain")


async def test_receiving_goes_on_while_notices_are_handled_up_to_max_in_flight(
    moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource
) -> None:
    for n in range(3):
        send(sqs, queue, spot(f"i-00000000000000{n:03d}"))
    async with aclosing(make_source(max_in_flight=2).notices()) as stream:
        first, second = await next_notice(stream), await next_notice(stream)
        receives = len(moto.calls("ReceiveMessage", QueueUrl=queue))
        third = asyncio.ensure_future(next_notice(stream))
        await asyncio.sleep(0.2)
        assert not third.done()
        assert len(moto.calls("ReceiveMessage", QueueUrl=queue)) == receives
        await ack(second).succeeded()
        assert (await third).instance_id not in {first.instance_id, second.instance_id}
        await ack(first).succeeded()
    assert all(c.params["MaxNumberOfMessages"] <= 2 for c in moto.calls("ReceiveMessage", QueueUrl=queue))


async def test_aws_errors_while_receiving_are_counted_and_do_not_end_the_iterator(
    moto: MotoServer, sqs: SQSClient, queue: str, make_source: MakeSource, registry: CollectorRegistry
) -> None:
    moto.fail("ReceiveMessage", status=503, code="ServiceUnavailable")
    moto.fail("ReceiveMessage", status=400, code="RequestThrottled")
    send(sqs, queue, spot())
    async with aclosing(make_source().notices()) as stream:
        await ack(await next_notice(stream)).succeeded()
    errors = {
        kind: registry.get_sample_value("spotdrain_sqs_errors_total", {"kind": kind})
        for kind in ("server", "throttled")
    }
    assert errors == {"server": 1, "throttled": 1}
