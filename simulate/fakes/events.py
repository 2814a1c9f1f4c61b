"""EventBridge events as AWS delivers them to an SQS queue, for the tests, the simulation and the benchmarks."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from email.utils import format_datetime
from typing import Any

from spotdrain.clock import rfc3339

ACCOUNT = "123456789012"
SPOT_WARNING = "EC2 Spot Instance Interruption Warning"


def eventbridge(
    detail_type: str,
    detail: dict[str, Any],
    *,
    time: datetime | str,
    region: str,
    source: str = "aws.ec2",
    resources: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The envelope every EventBridge event comes in, with a fresh id."""
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": detail_type,
        "source": source,
        "account": ACCOUNT,
        "time": time if isinstance(time, str) else rfc3339(time.replace(microsecond=0)),
        "region": region,
        "resources": list(resources),
        "detail": detail,
    }


def spot_warning(instance: str, *, time: datetime | str, region: str) -> str:
    """The message EC2 sends two minutes before it reclaims a Spot instance, as a queue body."""
    detail = {"instance-id": instance, "instance-action": "terminate"}
    arn = f"arn:aws:ec2:{region}a:instance/{instance}"
    return json.dumps(eventbridge(SPOT_WARNING, detail, time=time, region=region, resources=(arn,)))


def health_change(
    instances: tuple[str, ...], *, arn: str, status: str, start: datetime, time: datetime | str, region: str
) -> str:
    """An AWS Health scheduled change for EC2 instances, as a queue body; ``status`` is upcoming, open or closed.

    The fields are those of the AWS Health EventBridge schema
    (https://docs.aws.amazon.com/health/latest/ug/aws-health-events-eventbridge-schema.html): one event keeps its
    ``eventArn`` through its updates and its closing. ``startTime`` is written as AWS Health writes it.
    """
    detail = {
        "eventArn": arn,
        "service": "EC2",
        "eventTypeCode": "AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED",
        "eventTypeCategory": "scheduledChange",
        "statusCode": status,
        "startTime": format_datetime(start.astimezone(UTC), usegmt=True),
        "eventDescription": [{"language": "en_US", "latestDescription": "The instance is scheduled for retirement."}],
        "affectedEntities": [{"entityValue": instance} for instance in instances],
    }
    return json.dumps(eventbridge("AWS Health Event", detail, time=time, region=region, source="aws.health"))


def state_change(instance: str, state: str, *, time: datetime | str, region: str) -> str:
    """EC2's instance state-change notification (``stopping``, ``shutting-down``, ``terminated``...) as a queue body."""
    detail = {"instance-id": instance, "state": state}
    arn = f"arn:aws:ec2:{region}a:instance/{instance}"
    return json.dumps(
        eventbridge("EC2 Instance State-change Notification", detail, time=time, region=region, resources=(arn,))
    )
