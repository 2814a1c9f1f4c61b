"""The SQS notice source: long-polls a queue and yields the notices its messages carry, each with its acknowledgement.

What becomes of a message:

- it carries notices: it stays invisible while the handler works (``heartbeat`` extends that) and is deleted once
  every one of its notices succeeded; an ASG lifecycle action is completed with ``CONTINUE`` first, and the message
  is deleted only after that call succeeded;
- the handler cannot act yet (its instance is not in the cluster yet): it comes back after ``retry_delay_s``, until
  it has been received ``max_receives`` times, then it is deleted;
- it is invalid, of an unknown kind, or asks for nothing (an ASG test notification): deleted at once, counted, logged.

AWS errors are counted by kind; throttling, 5xx and lost connections are retried with backoff and never end the
iterator.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING, TypeVar

import structlog

from agent.notices.messages import Ignored, Invalid, LifecycleAction, Notices, parse
from agent.notices.notice import Notice
from agent.notices.sqs_calls import AwsQueue, clients
from spotdrain.clock import rfc3339, utcnow
from spotdrain.metrics import CollectorRegistry, Counter, zeroed
from spotdrain.retry import BACKOFF_S, ApiError

if TYPE_CHECKING:
    from mypy_boto3_sqs.type_defs import MessageTypeDef

log = structlog.get_logger()
T = TypeVar("T")

MAX_BATCH = 10  # the most SQS hands out per ReceiveMessage
MAX_WAIT_S = 20  # the longest long poll SQS allows
ERROR_KINDS = ("unreachable", "conflict", "throttled", "server", "client")


class Outcome(enum.StrEnum):
    HANDLED = "handled"
    DROPPED = "dropped"  # the handler found every notice of the message unusable
    DROPPED_INVALID = "dropped-invalid"
    DROPPED_UNKNOWN = "dropped-unknown"
    DROPPED_IGNORED = "dropped-ignored"
    RETRIED = "retried"
    DROPPED_UNMATCHED = "dropped-unmatched"  # retried until max_receives, never handled


@dataclass(frozen=True)
class SqsMetrics:
    messages: Counter
    errors: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> SqsMetrics:
        messages = Counter(
            "spotdrain_sqs_messages", "SQS messages by what became of them", ["outcome"], registry=registry
        )
        errors = Counter(
            "spotdrain_sqs_errors", "Failed AWS calls of the SQS source, by kind", ["kind"], registry=registry
        )
        zeroed(messages, "outcome", [outcome.value for outcome in Outcome])
        zeroed(errors, "kind", ERROR_KINDS)
        return cls(messages=messages, errors=errors)

    def count(self, outcome: Outcome) -> None:
        self.messages.labels(outcome=outcome.value).inc()

    def failed(self, error: ApiError) -> None:
        self.errors.labels(kind=error.kind).inc()


@dataclass(frozen=True)
class _Policy:
    max_receives: int
    retry_delay_s: float
    visibility_timeout_s: float


@dataclass(eq=False)
class _Message:
    """A received message whose notices are with the handler; settled once, by the first retry or the last notice."""

    queue: AwsQueue
    policy: _Policy
    metrics: SqsMetrics
    on_settled: Callable[[], Awaitable[None]]
    id: str
    receipt: str
    receives: int
    lifecycle: LifecycleAction | None
    pending: int
    succeeded: int = 0
    settled: bool = False

    async def notice_done(self, *, succeeded: bool) -> None:
        self.pending -= 1
        self.succeeded += succeeded
        if self.pending or self.settled:
            return
        self.settled = True
        # A dropped lifecycle notice is not completed: the hook's own timeout and default result decide then.
        if self.lifecycle is not None and self.succeeded:
            if not await self.queue.complete(self.lifecycle):
                await self._again("CompleteLifecycleAction failed")
                return
            log.info("sqs.lifecycle_completed", message=self.id, hook=self.lifecycle.hook_name, result="CONTINUE")
        await self.queue.delete(self.receipt)
        outcome = Outcome.HANDLED if self.succeeded else Outcome.DROPPED
        log.info("sqs.message_done", message=self.id, outcome=outcome.value)
        await self._settle(outcome)

    async def retry(self, reason: str) -> None:
        if not self.settled:
            self.settled = True
            await self._again(reason)

    async def heartbeat(self) -> None:
        if self.settled:
            return
        await self.queue.hide(self.receipt, self.policy.visibility_timeout_s)
        if self.lifecycle is not None:
            await self.queue.record_heartbeat(self.lifecycle)

    async def _again(self, reason: str) -> None:
        if self.receives >= self.policy.max_receives:
            log.warning("sqs.gave_up", message=self.id, receives=self.receives, reason=reason)
            await self.queue.delete(self.receipt)
            await self._settle(Outcome.DROPPED_UNMATCHED)
            return
        log.info("sqs.retry", message=self.id, receives=self.receives, reason=reason, in_s=self.policy.retry_delay_s)
        await self.queue.hide(self.receipt, self.policy.retry_delay_s)
        await self._settle(Outcome.RETRIED)

    async def _settle(self, outcome: Outcome) -> None:
        self.metrics.count(outcome)
        await self.on_settled()


class _Ack:
    """One notice's acknowledgement (``agent.notices.notice.Acknowledgement``); only its first answer counts."""

    def __init__(self, message: _Message) -> None:
        self._message = message
        self._answered = False

    def _first(self) -> bool:
        first = not self._answered
        self._answered = True
        return first

    async def succeeded(self) -> None:
        if self._first():
            await self._message.notice_done(succeeded=True)

    async def retry(self, reason: str) -> None:
        if self._first():
            await self._message.retry(reason)

    async def drop(self, reason: str) -> None:
        if self._first():
            log.info("sqs.notice_dropped", message=self._message.id, reason=reason)
            await self._message.notice_done(succeeded=False)

    async def heartbeat(self) -> None:
        if not self._answered:
            await self._message.heartbeat()


class SqsSource:
    """Notices from an SQS queue fed by EventBridge rules, SNS topics or ASG lifecycle hooks."""

    def __init__(
        self,
        *,
        queue_url: str,
        region: str,
        metrics: SqsMetrics,
        endpoint_url: str | None = None,
        max_receives: int = 5,
        visibility_timeout_s: float = 30,
        wait_time_s: float = 20,
        max_in_flight: int = 50,
        retry_delay_s: float = 10,
        asg_budget_s: float = 120,
        backoff_s: Sequence[float] = BACKOFF_S,
    ) -> None:
        sqs, autoscaling = clients(
            region=region, endpoint_url=endpoint_url, pool=max_in_flight + 2, read_timeout_s=wait_time_s + 10
        )
        self._queue = AwsQueue(
            sqs=sqs, autoscaling=autoscaling, url=queue_url, backoff_s=backoff_s, on_error=metrics.failed
        )
        self._policy = _Policy(max_receives, retry_delay_s, visibility_timeout_s)
        self.last_receive: datetime | None = None  # when the queue last answered a receive
        self._wait_time_s = min(MAX_WAIT_S, math.ceil(wait_time_s))
        self._max_in_flight = max_in_flight
        self._asg_budget_s = asg_budget_s
        self._metrics = metrics
        self._unfinished = 0
        self._changed = asyncio.Condition()

    async def notices(self) -> AsyncGenerator[Notice, None]:
        """Long-polls the queue and yields every notice its messages carry; returns only when closed or cancelled.

        Receiving goes on while earlier notices are being handled, as long as fewer than ``max_in_flight`` messages
        are unfinished (a message is finished once its notices were acknowledged). A notice left unacknowledged for
        longer than ``visibility_timeout_s`` without a ``heartbeat`` comes back as a second notice with the same id.
        """
        log.info("sqs.started", queue_url=self._queue.url, max_in_flight=self._max_in_flight)
        while True:
            count = await self._room()
            messages = await self._queue.receive(
                count, wait_time_s=self._wait_time_s, visibility_timeout_s=math.ceil(self._policy.visibility_timeout_s)
            )
            self.last_receive = utcnow()
            for message in messages:
                for notice in await self._accept(message):
                    yield notice

    def status(self) -> dict[str, str | None]:
        """What ``spotdrain check --node`` shows of this source: the queue and when it last answered."""
        last = None if self.last_receive is None else rfc3339(self.last_receive)
        return {"url": self._queue.url, "last_receive": last}

    async def _room(self) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self._unfinished < self._max_in_flight)
            return min(MAX_BATCH, self._max_in_flight - self._unfinished)

    async def _settled(self) -> None:
        async with self._changed:
            self._unfinished -= 1
            self._changed.notify_all()

    async def _accept(self, message: MessageTypeDef) -> list[Notice]:
        message_id, receipt = message.get("MessageId", ""), message.get("ReceiptHandle", "")
        parsed = parse(message.get("Body", ""), asg_budget_s=self._asg_budget_s)
        if isinstance(parsed, Notices) and parsed.notices:
            return self._track(message_id, receipt, _receives(message), parsed)
        if isinstance(parsed, Ignored):
            outcome = Outcome.DROPPED_IGNORED
            log.info("sqs.ignored", message=message_id, reason=parsed.reason)
        else:
            outcome = (
                Outcome.DROPPED_UNKNOWN if isinstance(parsed, Invalid) and parsed.unknown else Outcome.DROPPED_INVALID
            )
            reason = parsed.reason if isinstance(parsed, Invalid) else "no notices"
            log.warning("sqs.dropped", message=message_id, outcome=outcome.value, reason=reason)
        await self._queue.delete(receipt)
        self._metrics.count(outcome)
        return []

    def _track(self, message_id: str, receipt: str, receives: int, parsed: Notices) -> list[Notice]:
        self._unfinished += 1
        tracked = _Message(
            queue=self._queue,
            policy=self._policy,
            metrics=self._metrics,
            on_settled=self._settled,
            id=message_id,
            receipt=receipt,
            receives=receives,
            lifecycle=parsed.lifecycle,
            pending=len(parsed.notices),
        )
        notices = [replace(notice, ack=_Ack(tracked)) for notice in parsed.notices]
        for notice in notices:
            log.info("sqs.notice", **notice.logged(), message=message_id, receives=receives)
        return notices


def _receives(message: MessageTypeDef) -> int:
    try:
        return int(message.get("Attributes", {}).get("ApproximateReceiveCount", "1"))
    except ValueError:
        return 1
