"""The AWS calls of the SQS source, run on worker threads, with AWS errors sorted like any other API's."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import boto3
import structlog
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    HTTPClientError,
)

from agent.notices.messages import LifecycleAction
from spotdrain.retry import ApiError, retrying

if TYPE_CHECKING:
    from mypy_boto3_autoscaling import AutoScalingClient
    from mypy_boto3_sqs import SQSClient
    from mypy_boto3_sqs.type_defs import MessageTypeDef

log = structlog.get_logger()
T = TypeVar("T")

# Throttling codes across services; Auto Scaling answers 400 "Throttling", SQS "RequestThrottled" or 429s.
THROTTLING = frozenset({"Throttling", "ThrottlingException", "RequestThrottled", "TooManyRequestsException"})
UNREACHABLE = (ConnectionError, HTTPClientError, CredentialRetrievalError)


def api_error(error: ClientError | BotoCoreError) -> ApiError:
    """An AWS error sorted like any other API's: throttling is a 429, a lost connection has no status."""
    if isinstance(error, ClientError):
        code = str(error.response.get("Error", {}).get("Code", ""))
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500))
        # Query-compatible services prefix codes (AWS.SimpleQueueService.RequestThrottled).
        return ApiError(429 if code.rpartition(".")[2] in THROTTLING else status, str(error))
    return ApiError(0 if isinstance(error, UNREACHABLE) else 400, f"{type(error).__name__}: {error}")


def clients(
    *, region: str, endpoint_url: str | None, pool: int, read_timeout_s: float
) -> tuple[SQSClient, AutoScalingClient]:
    """One client per service, made once: boto3 clients may be shared by threads (boto3 sessions may not)."""
    # Retries are ours (counted, logged, with the project's backoff), so botocore makes each call once.
    config = Config(
        retries={"mode": "standard", "total_max_attempts": 1},
        connect_timeout=5,
        read_timeout=read_timeout_s,
        max_pool_connections=pool,
    )
    session = boto3.session.Session()
    return (
        session.client("sqs", region_name=region, endpoint_url=endpoint_url, config=config),
        session.client("autoscaling", region_name=region, endpoint_url=endpoint_url, config=config),
    )


class AwsQueue:
    """The AWS calls of the source, on worker threads; every call but ``receive`` logs its failure and says False."""

    def __init__(
        self,
        *,
        sqs: SQSClient,
        autoscaling: AutoScalingClient,
        url: str,
        backoff_s: Sequence[float],
        on_error: Callable[[ApiError], None],
    ) -> None:
        self.sqs = sqs
        self.autoscaling = autoscaling
        self.url = url
        self.backoff_s = tuple(backoff_s)
        self.on_error = on_error

    async def _call(self, what: str, call: Callable[[], T], *, forever: bool = False) -> T:
        async def attempt() -> T:
            try:
                return await asyncio.to_thread(call)
            except (ClientError, BotoCoreError) as error:
                raise api_error(error) from error

        return await retrying(attempt, what=what, backoff_s=self.backoff_s, forever=forever, on_error=self.on_error)

    async def _try(self, what: str, call: Callable[[], object]) -> bool:
        try:
            await self._call(what, call)
        except ApiError as error:
            log.warning("sqs.call_failed", call=what, error=str(error), kind=error.kind)
            return False
        return True

    async def receive(self, count: int, *, wait_time_s: int, visibility_timeout_s: int) -> list[MessageTypeDef]:
        """Up to ``count`` messages, after at most ``wait_time_s``; an empty list after an error that persists."""
        try:
            answer = await self._call(
                "sqs.receive_message",
                lambda: self.sqs.receive_message(
                    QueueUrl=self.url,
                    MaxNumberOfMessages=count,
                    WaitTimeSeconds=wait_time_s,
                    VisibilityTimeout=visibility_timeout_s,
                    MessageSystemAttributeNames=["ApproximateReceiveCount"],
                ),
                forever=True,
            )
        except ApiError as error:  # not transient (no such queue, access denied): keep trying, slowly and loudly
            log.error("sqs.receive_failed", queue_url=self.url, error=str(error), retry_in_s=self.backoff_s[-1])
            await asyncio.sleep(self.backoff_s[-1])
            return []
        return answer.get("Messages", [])

    async def delete(self, receipt: str) -> bool:
        return await self._try(
            "sqs.delete_message", lambda: self.sqs.delete_message(QueueUrl=self.url, ReceiptHandle=receipt)
        )

    async def hide(self, receipt: str, seconds: float) -> bool:
        return await self._try(
            "sqs.change_message_visibility",
            lambda: self.sqs.change_message_visibility(
                QueueUrl=self.url, ReceiptHandle=receipt, VisibilityTimeout=math.ceil(seconds)
            ),
        )

    async def complete(self, action: LifecycleAction) -> bool:
        return await self._try(
            "autoscaling.complete_lifecycle_action",
            lambda: self.autoscaling.complete_lifecycle_action(
                LifecycleHookName=action.hook_name,
                AutoScalingGroupName=action.group_name,
                LifecycleActionToken=action.token,
                InstanceId=action.instance_id,
                LifecycleActionResult="CONTINUE",
            ),
        )

    async def record_heartbeat(self, action: LifecycleAction) -> bool:
        return await self._try(
            "autoscaling.record_lifecycle_action_heartbeat",
            lambda: self.autoscaling.record_lifecycle_action_heartbeat(
                LifecycleHookName=action.hook_name,
                AutoScalingGroupName=action.group_name,
                LifecycleActionToken=action.token,
                InstanceId=action.instance_id,
            ),
        )
