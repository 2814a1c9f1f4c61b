"""EventBridge events as AWS delivers them to an SQS queue, for the tests, the simulation and the benchmarks."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
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
