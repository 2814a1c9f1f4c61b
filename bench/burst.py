"""Queue mode burst: 1,000 Spot interruption messages for 1,000 nodes, 10 ms added to every API call.

Measures the time from the agent's start until every node is tainted (target under 10 s), under the API rate limit
the queue Deployment ships (above the queue-mode default: 1,000 nodes at once take about 3,000 calls), and checks
that every message was deleted exactly once: all handled, none retried or dropped, the queue empty. moto's SQS runs
in a process of its own so that the harness does not share a core with the fake API server.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import boto3
import yaml

from agent.drain.planning import TAINT_KEY
from bench.common import Result, cpu_s
from sidecar.engines import sum_samples
from simulate.fakes.aws import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY
from simulate.fakes.events import spot_warning
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, start, status_of
from spotdrain.clock import utcnow

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient

NODES = 1000
API_LATENCY_S = 0.010
TARGET_S = 10.0
QUEUE_DEPLOYMENT = Path(__file__).resolve().parents[1] / "daemonset" / "queue" / "deployment.yaml"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY}


def tainted(kube: FakeKube) -> int:
    nodes = (kube.node(f"gpu-{i}") for i in range(NODES))
    return sum(any(t.get("key") == TAINT_KEY for t in n["spec"].get("taints") or []) for n in nodes)


async def moto_process() -> tuple[asyncio.subprocess.Process, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "simulate.fakes.aws", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    assert process.stdout is not None
    return process, (await process.stdout.readline()).decode().strip()


def sqs_client(endpoint: str) -> SQSClient:
    return boto3.client(
        "sqs",
        region_name=REGION,
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
    )


def fill_queue(endpoint: str, instances: list[str]) -> str:
    sqs = sqs_client(endpoint)
    queue = sqs.create_queue(QueueName="burst")["QueueUrl"]
    for first in range(0, len(instances), 10):
        batch = instances[first : first + 10]
        bodies = [spot_warning(instance, time=utcnow(), region=REGION) for instance in batch]
        entries = [{"Id": str(i), "MessageBody": body} for i, body in enumerate(bodies)]
        sqs.send_message_batch(QueueUrl=queue, Entries=entries)  # type: ignore[arg-type]
    return queue


def messages_left(endpoint: str, queue: str) -> int:
    sqs = sqs_client(endpoint)
    attributes = sqs.get_queue_attributes(
        QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])


def shipped_api_limits() -> list[str]:
    """The queue Deployment's own ``--api-qps`` and ``--api-burst``, so the figure is for the limits that ship."""
    deployment = yaml.safe_load(QUEUE_DEPLOYMENT.read_text())
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return [word for flag in ("--api-qps", "--api-burst") for word in (flag, args[args.index(flag) + 1])]


async def outcomes(metrics_port: int) -> dict[str, float]:
    _, page = await status_of(f"http://127.0.0.1:{metrics_port}/metrics")
    names = ("handled", "retried", "dropped", "dropped-invalid", "dropped-unknown", "dropped-unmatched")
    return {name: sum_samples(page, f'spotdrain_sqs_messages_total{{outcome="{name}"}}') or 0 for name in names}


async def measure() -> list[Result]:
    moto, endpoint = await moto_process()
    instances = [f"i-{index:017x}" for index in range(NODES)]
    queue = fill_queue(endpoint, instances)
    metrics_port = free_port()
    try:
        with tempfile.TemporaryDirectory(prefix="spotdrain-bench-burst-") as workdir:
            async with FakeKube(latency_s=API_LATENCY_S) as kube:
                for index, instance in enumerate(instances):
                    kube.add_node(f"gpu-{index}", provider_id=f"aws:///{REGION}a/{instance}")
                kubeconfig = kube.write_kubeconfig(Path(workdir) / "kubeconfig")
                args = [
                    "-m",
                    "spotdrain.cli",
                    "--log-level",
                    "warning",
                    "node",
                    "--queue-url",
                    queue,
                    "--aws-region",
                    REGION,
                    "--aws-endpoint-url",
                    endpoint,
                    "--kubeconfig",
                    str(kubeconfig),
                    "--host",
                    "127.0.0.1",
                    "--metrics-port",
                    str(metrics_port),
                    "--notice-port",
                    str(free_port()),
                    *shipped_api_limits(),
                    "--sqs-wait-time",
                    "1",
                ]
                started = time.monotonic()
                agent = await start(args, log_path=Path(workdir) / "agent.log", env=CREDENTIALS)
                try:
                    while tainted(kube) < NODES and time.monotonic() - started < 120:
                        await asyncio.sleep(0.5)
                    took = time.monotonic() - started
                    while messages_left(endpoint, queue) and time.monotonic() - started < 180:
                        await asyncio.sleep(0.5)
                    counted = await outcomes(metrics_port)
                    agent_cpu = cpu_s(agent.pid)
                finally:
                    agent.terminate()
                    await agent.wait()
                done = tainted(kube)
    finally:
        moto.terminate()
        await moto.wait()
    exactly_once = counted["handled"] == NODES and sum(counted.values()) == NODES
    harness_s = time.process_time()
    detail = (
        f"{done}/{NODES} nodes tainted; SQS outcomes {counted}; CPU: agent {agent_cpu:.1f} s, harness {harness_s:.1f} s"
    )
    return [Result("queue_burst_all_tainted", round(took, 3), "s", TARGET_S, took < TARGET_S and exactly_once, detail)]


if __name__ == "__main__":
    from bench.common import report

    report(asyncio.run(measure()))
