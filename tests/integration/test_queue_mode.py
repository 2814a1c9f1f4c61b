"""``spotdrain node`` in queue mode: EventBridge, SNS and ASG messages from moto's SQS, acted on in the fake API."""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import AbstractAsyncContextManager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from structlog.testing import capture_logs

from agent.drain.planning import NOTICE_ID, TAINT_KEY
from simulate.fakes.aws import REGION, MotoServer
from simulate.fakes.events import eventbridge, health_change, spot_warning, state_change
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import status_of
from spotdrain.clock import rfc3339, utcnow
from tests.conftest import Kube, granted_token, node_agent, until
from tests.deploy.manifests import grants, needed, render

if TYPE_CHECKING:
    from mypy_boto3_sqs import SQSClient


# Pods take this long to go once evicted, as when their containers exit.
EXIT_S = 0.8


def spot(instance: str) -> str:
    return spot_warning(instance, time=utcnow(), region=REGION)


def lifecycle(instance: str, token: str) -> str:
    return json.dumps(
        {
            "Service": "AWS Auto Scaling",
            "Time": rfc3339(utcnow()),
            "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
            "EC2InstanceId": instance,
            "LifecycleActionToken": token,
            "LifecycleHookName": "spotdrain",
            "AutoScalingGroupName": "gpu-nodes",
        }
    )


def queue_agent(
    kube: Kube, moto: MotoServer, queue: str, tmp_path: Path, *flags: str, token: str | None = None
) -> AbstractAsyncContextManager[int]:
    """The node agent in queue mode on moto's queue; yields its notice port."""
    aws = (
        "--queue-url",
        queue,
        "--aws-region",
        REGION,
        "--aws-endpoint-url",
        moto.endpoint_url,
        "--sqs-wait-time",
        "1",
    )
    limits = ("--api-qps", "200", "--api-burst", "100")
    return node_agent(kube, tmp_path / "kubeconfig", *aws, *limits, *flags, token=token)


def messages_left(sqs: SQSClient, queue: str) -> int:
    attributes = sqs.get_queue_attributes(
        QueueUrl=queue, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    )["Attributes"]
    return int(attributes["ApproximateNumberOfMessages"]) + int(attributes["ApproximateNumberOfMessagesNotVisible"])


@pytest.fixture
def kube(any_kube: Kube) -> Kube:
    """Four GPU nodes with a pod each, on the fake and on the real API server."""
    for index in range(1, 5):
        any_kube.add_node(f"gpu-{index}", provider_id=f"aws:///{REGION}a/i-000000000000000{index}")
        any_kube.add_pod("ml", f"vllm-{index}", node=f"gpu-{index}", owner_kind="ReplicaSet")

    def exit_soon(pod: dict[str, Any], grace_s: int) -> None:
        asyncio.get_running_loop().call_later(
            0.2, any_kube.remove_pod, pod["metadata"]["namespace"], pod["metadata"]["name"]
        )

    any_kube.on_delete(exit_soon)
    return any_kube


async def test_every_delivery_kind_drains_its_node_and_is_deleted_once_done(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    token = str(uuid.uuid4())
    sqs.send_message(QueueUrl=queue, MessageBody=spot("i-0000000000000001"))
    sns = {"Type": "Notification", "MessageId": "m-1", "Message": spot("i-0000000000000002")}
    sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(sns))
    sqs.send_message(QueueUrl=queue, MessageBody=lifecycle("i-0000000000000003", token))
    sqs.send_message(QueueUrl=queue, MessageBody=json.dumps({"Event": "autoscaling:TEST_NOTIFICATION"}))
    sqs.send_message(QueueUrl=queue, MessageBody="{not json")
    async with queue_agent(kube, moto, queue, tmp_path) as notice_port:
        await until(lambda: all(kube.pod("ml", f"vllm-{i}") is None for i in (1, 2, 3)))
        await until(lambda: messages_left(sqs, queue) == 0)
        status, body = await status_of(f"http://127.0.0.1:{notice_port}/v1/notice?node=gpu-2")
        assert status == 200
        assert json.loads(body)["source"] == "sqs"
        assert (await status_of(f"http://127.0.0.1:{notice_port}/v1/notice?node=gpu-4"))[0] == 204
        assert (await status_of(f"http://127.0.0.1:{notice_port}/v1/notice"))[0] == 400
    for index in (1, 2, 3):
        node = kube.node(f"gpu-{index}")
        assert node["spec"]["unschedulable"] is True
        assert any(t["key"] == TAINT_KEY for t in node["spec"]["taints"])
    assert "unschedulable" not in kube.node("gpu-4")["spec"]
    assert kube.pod("ml", "vllm-4") is not None
    # moto serves the whole module (the fake's case and the real one's): only this queue's and hook's calls count.
    completed = moto.calls("CompleteLifecycleAction", LifecycleActionToken=token)
    assert len(completed) == 1
    assert completed[0].params["LifecycleActionResult"] == "CONTINUE"
    assert len(moto.calls("DeleteMessage", QueueUrl=queue)) == 5
    nodes_listed = [c for c in kube.calls if c.method == "GET" and c.path == "/api/v1/nodes"]
    assert 1 <= len(nodes_listed) <= 3, "instance ids are mapped through a cached node list, not one LIST each"


async def test_a_lifecycle_action_is_completed_only_after_the_pods_are_gone(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    token = str(uuid.uuid4())
    sqs.send_message(QueueUrl=queue, MessageBody=lifecycle("i-0000000000000004", token))
    async with queue_agent(kube, moto, queue, tmp_path):
        await until(lambda: bool(kube.deletions))
        assert moto.calls("CompleteLifecycleAction", LifecycleActionToken=token) == []
        await until(lambda: len(moto.calls("CompleteLifecycleAction", LifecycleActionToken=token)) == 1)
        assert kube.pod("ml", "vllm-4") is None, "the instance may go only once its pods have"


async def test_an_event_within_its_deadline_is_timed_from_the_event_not_from_receipt(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    sqs.send_message(QueueUrl=queue, MessageBody=spot("i-0000000000000001"))
    async with queue_agent(kube, moto, queue, tmp_path):
        await until(lambda: kube.pod("ml", "vllm-1") is None)
    annotation = kube.node("gpu-1")["metadata"]["annotations"]["spotdrain.io/termination-time"]
    assert (
        abs(
            (
                utcnow() + timedelta(seconds=120) - __import__("spotdrain.clock").clock.parse_rfc3339(annotation)
            ).total_seconds()
        )
        < 10
    )


async def test_a_burst_of_messages_for_many_nodes_is_handled_once_each(
    moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    nodes = 60
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    async with FakeKube(latency_s=0.005) as kube:
        for index in range(nodes):
            kube.add_node(f"burst-{index}", provider_id=f"aws:///{REGION}a/i-{index:017x}")
        for first in range(0, nodes, 10):
            entries = [{"Id": str(i), "MessageBody": spot(f"i-{i:017x}")} for i in range(first, first + 10)]
            sqs.send_message_batch(QueueUrl=queue, Entries=entries)  # type: ignore[arg-type]
        async with queue_agent(kube, moto, queue, tmp_path):
            await until(lambda: messages_left(sqs, queue) == 0, timeout_s=30)
        assert all(kube.node(f"burst-{i}")["spec"].get("unschedulable") for i in range(nodes))
    deleted = [c for c in moto.calls("DeleteMessage") if c.params["QueueUrl"] == queue]
    assert len(deleted) == nodes
    assert len({c.params["ReceiptHandle"] for c in deleted}) == nodes


async def test_a_closed_health_event_unmarks_the_node_its_open_event_marked(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    arn = "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/AWS_EC2_RETIREMENT_1a2b3c"
    start = utcnow() + timedelta(days=2)

    def change(status: str, at: datetime) -> str:
        return health_change(("i-0000000000000001",), arn=arn, status=status, start=at, time=utcnow(), region=REGION)

    sqs.send_message(QueueUrl=queue, MessageBody=change("upcoming", start))
    async with queue_agent(kube, moto, queue, tmp_path) as notice_port:
        notice_url = f"http://127.0.0.1:{notice_port}/v1/notice?node=gpu-1"
        await until(lambda: kube.node("gpu-1")["spec"].get("unschedulable") is True)
        await until(lambda: messages_left(sqs, queue) == 0)
        assert (await status_of(notice_url))[0] == 200
        sqs.send_message(QueueUrl=queue, MessageBody=change("closed", start + timedelta(hours=3)))
        await until(lambda: "unschedulable" not in kube.node("gpu-1")["spec"])
        await until(lambda: messages_left(sqs, queue) == 0)
        assert (await status_of(notice_url))[0] == 204
    node = kube.node("gpu-1")
    assert not [t for t in node["spec"].get("taints") or [] if t["key"] == TAINT_KEY]
    assert NOTICE_ID not in (node["metadata"].get("annotations") or {})
    assert [e["reason"] for e in kube.events()] == ["InterruptionNotice", "InterruptionWithdrawn"]


async def test_an_instance_already_shutting_down_is_evicted_with_one_second_of_grace_not_zero(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    body = state_change("i-0000000000000002", "shutting-down", time=utcnow(), region=REGION)
    sqs.send_message(QueueUrl=queue, MessageBody=body)
    async with queue_agent(kube, moto, queue, tmp_path):
        await until(lambda: bool(kube.deletions))
    # The event time is the deadline, already past: grace 0 would delete the pod without its preStop.
    assert [(d.name, d.grace_s) for d in kube.deletions] == [("vllm-2", 1)]


async def test_a_late_notice_for_an_instance_whose_node_name_was_reused_touches_no_node(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    old, new = "i-0000000000000001", "i-0000000000000009"
    rebalance = eventbridge("EC2 Instance Rebalance Recommendation", {"instance-id": old}, time=utcnow(), region=REGION)
    sqs.send_message(QueueUrl=queue, MessageBody=json.dumps(rebalance))  # the agent learns old -> gpu-1
    with capture_logs() as logs:
        async with queue_agent(kube, moto, queue, tmp_path, "--max-receives", "1"):
            await until(lambda: bool(kube.node("gpu-1")["spec"].get("taints")))
            await until(lambda: messages_left(sqs, queue) == 0)
            kube.replace_node("gpu-1", provider_id=f"aws:///{REGION}a/{new}")
            kube.add_pod("ml", "vllm-new", node="gpu-1", owner_kind="ReplicaSet")
            terminated = state_change(old, "terminated", time=utcnow(), region=REGION)
            sqs.send_message(QueueUrl=queue, MessageBody=terminated)
            await until(lambda: any(e["event"] == "sqs.gave_up" for e in logs) or bool(kube.deletions))
            assert kube.deletions == []
            assert "taints" not in kube.node("gpu-1")["spec"]
            assert "unschedulable" not in kube.node("gpu-1")["spec"]
            assert kube.pod("ml", "vllm-new") is not None
            sqs.send_message(QueueUrl=queue, MessageBody=spot(new))  # the new instance is found under the same name
            await until(lambda: kube.node("gpu-1")["spec"].get("unschedulable") is True)
            await until(lambda: messages_left(sqs, queue) == 0)
    assert any(e["event"] == "node.replaced" and e["found"] == new for e in logs)
    assert [d.name for d in kube.deletions] == ["vllm-new"]


async def test_queue_mode_calls_exactly_what_its_account_is_granted(
    kube: Kube, moto: MotoServer, sqs: SQSClient, tmp_path: Path
) -> None:
    rendered = render("daemonset/queue-mode")
    granted = grants(rendered, "spotdrain", "spotdrain-queue")
    token = granted_token(kube, rendered, "spotdrain", "spotdrain-queue")  # the real server: exactly these grants
    queue = sqs.create_queue(QueueName=f"q-{uuid.uuid4().hex[:10]}")["QueueUrl"]
    arn = "arn:aws:health:us-east-1::event/EC2/AWS_EC2_INSTANCE_RETIREMENT_SCHEDULED/AWS_EC2_RETIREMENT_4d5e6f"

    def change(status: str) -> str:
        start = utcnow() + timedelta(days=1)
        return health_change(("i-0000000000000002",), arn=arn, status=status, start=start, time=utcnow(), region=REGION)

    sqs.send_message(QueueUrl=queue, MessageBody=spot("i-0000000000000001"))
    sqs.send_message(QueueUrl=queue, MessageBody=change("open"))
    # As daemonset/queue runs it: with the installation checks, whose list calls its role grants too.
    async with queue_agent(kube, moto, queue, tmp_path, "--check-interval", "0.5", token=token):
        await until(lambda: kube.pod("ml", "vllm-1") is None and kube.pod("ml", "vllm-2") is None)
        await until(lambda: messages_left(sqs, queue) == 0)
        sqs.send_message(QueueUrl=queue, MessageBody=change("closed"))
        await until(lambda: "unschedulable" not in kube.node("gpu-2")["spec"])
        await until(lambda: messages_left(sqs, queue) == 0)
        await until(
            lambda: kube.count("GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations") > 0
        )
    assert needed(kube.calls, granted) == granted
