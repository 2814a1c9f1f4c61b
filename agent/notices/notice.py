"""The one thing every notice source produces: a ``Notice`` that the node handler acts on.

Deadlines, by kind (all UTC):

| kind | where from | deadline |
| --- | --- | --- |
| spot-interruption | IMDS spot/instance-action, EventBridge warning | ``time`` (IMDS) or event time + 120 s |
| rebalance-recommendation | IMDS rebalance, EventBridge rebalance | notice time + 120 s (earliest possible end) |
| scheduled-maintenance | IMDS events/maintenance/scheduled | the event's ``NotBefore`` |
| asg-termination | IMDS target-lifecycle-state, ASG lifecycle hook | detection / event time + the ASG drain budget |
| instance-stopping / instance-terminating | EventBridge state-change | the event time (it is happening now) |
| health-scheduled-change | AWS Health event | the event's ``startTime`` |
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from spotdrain.clock import rfc3339

SPOT_WARNING = timedelta(seconds=120)


class Kind(enum.StrEnum):
    SPOT_INTERRUPTION = "spot-interruption"
    REBALANCE_RECOMMENDATION = "rebalance-recommendation"
    SCHEDULED_MAINTENANCE = "scheduled-maintenance"
    ASG_TERMINATION = "asg-termination"
    INSTANCE_STOPPING = "instance-stopping"
    INSTANCE_TERMINATING = "instance-terminating"
    HEALTH_SCHEDULED_CHANGE = "health-scheduled-change"

    @property
    def definitive(self) -> bool:
        """The instance will go away; a rebalance recommendation only says it might."""
        return self is not Kind.REBALANCE_RECOMMENDATION


class Source(enum.StrEnum):
    IMDS = "imds"
    SQS = "sqs"


class Acknowledgement(Protocol):
    """How the handler tells a notice's source what became of it (SQS messages, ASG lifecycle actions)."""

    async def succeeded(self) -> None:
        """The action the notice asked for is done: delete the message, complete a lifecycle action."""

    async def retry(self, reason: str) -> None:
        """Not done yet (or the instance is not known yet): let it come back, within the source's limits."""

    async def drop(self, reason: str) -> None:
        """Unusable: acknowledge and forget it."""

    async def heartbeat(self) -> None:
        """Still working on it: extend the message's visibility, record a lifecycle heartbeat."""


@dataclass(frozen=True)
class Notice:
    kind: Kind
    instance_id: str
    deadline: datetime
    source: Source
    detail: str = ""  # what the notice was made from (EventId, instance action, hook name), part of its identity
    withdrawn: bool = False  # a canceled or completed scheduled event: undo what the notice did
    ack: Acknowledgement | None = field(default=None, compare=False, repr=False)

    @property
    def reckoned(self) -> bool:
        """The deadline is the agent's own reckoning from when it first saw the notice, not a time AWS stated: IMDS
        ``target-lifecycle-state`` says only ``Terminated``. The node keeps the first deadline (see planning)."""
        return self.source is Source.IMDS and self.kind is Kind.ASG_TERMINATION

    @property
    def id(self) -> str:
        """Deterministic: the same notice polled twice, or delivered twice, has the same id.

        An AWS Health event is named by its eventArn, which it keeps through its updates and its closing while its
        startTime may move: the deadline is left out of its id, so a withdrawal carries the id it withdraws.
        """
        deadline = "" if self.kind is Kind.HEALTH_SCHEDULED_CHANGE else rfc3339(self.deadline)
        key = "|".join((self.kind.value, self.instance_id, deadline, self.detail))
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def logged(self) -> dict[str, str]:
        """The fields every log line about this notice carries, in every module that logs one."""
        return {
            "notice": self.id,
            "kind": self.kind.value,
            "instance": self.instance_id,
            "deadline": rfc3339(self.deadline),
        }

    def public(self) -> dict[str, str]:
        """The node-local endpoint's JSON body for this notice."""
        return {"id": self.id, "kind": self.kind.value, "deadline": rfc3339(self.deadline), "source": self.source.value}
