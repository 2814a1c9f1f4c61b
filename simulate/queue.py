"""The ``sqs`` scenario's delivery: moto's server as a process, one queue, and the EventBridge Spot warning on it.

EventBridge's Spot warning carries no deadline: the node agent takes the event's ``time`` plus 120 s. To compress
time, the message is dated as if it had been sent 120 s before the deadline the simulation wants, which is what a
message that spent that long on its way looks like; the agent times the drain from the event, not from receipt.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from simulate.fakes.events import spot_warning
from simulate.procs import ProcessGroup

SPOT_WARNING = timedelta(seconds=120)


class Queue:
    def __init__(self, procs: ProcessGroup) -> None:
        self.procs = procs
        self.endpoint_url = ""
        self.url = ""
        self._client: Any = None
        from simulate.fakes.aws import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY  # moto loads only for this scenario

        self.region = REGION
        self.credentials = {"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY}

    async def start(self, *, timeout_s: float = 30.0) -> None:
        """Start ``python -m simulate.fakes.aws`` and create the queue; returns once the queue exists."""
        proc = await self.procs.start("aws", ["-m", "simulate.fakes.aws"])
        self.endpoint_url = await asyncio.wait_for(proc.first_line, timeout_s)
        if not self.endpoint_url.startswith("http"):
            raise RuntimeError(f"the AWS fake did not start: {self.endpoint_url!r} (see {proc.log_path})")
        import boto3

        self._client = boto3.client(
            "sqs",
            region_name=self.region,
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
        )
        answer = await asyncio.to_thread(self._client.create_queue, QueueName="spot-interruptions")
        self.url = answer["QueueUrl"]

    def agent_flags(self) -> dict[str, str]:
        return {"--queue-url": self.url, "--aws-region": self.region, "--aws-endpoint-url": self.endpoint_url}

    async def send_spot_warning(self, *, instance: str, deadline: datetime) -> None:
        body = spot_warning(instance, time=deadline - SPOT_WARNING, region=self.region)
        await asyncio.to_thread(self._client.send_message, QueueUrl=self.url, MessageBody=body)

    async def empty(self) -> bool:
        """No message left in the queue, visible or in flight."""
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        answer = await asyncio.to_thread(self._client.get_queue_attributes, QueueUrl=self.url, AttributeNames=names)
        return sum(int(answer["Attributes"][name]) for name in names) == 0

    async def wait_empty(self, *, timeout_s: float, interval_s: float = 0.25) -> bool:
        """True once the queue is empty, False if it still is not after ``timeout_s``."""
        try:
            async with asyncio.timeout(timeout_s):
                while not await self.empty():
                    await asyncio.sleep(interval_s)
        except TimeoutError:
            return False
        return True
