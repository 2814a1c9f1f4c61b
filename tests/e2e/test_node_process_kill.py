"""The real ``spotdrain node`` process killed with SIGKILL mid-notice, at the moment one of its API requests arrives,
then started again over the same cluster: the drain is finished, nothing is done twice."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, start
from spotdrain.clock import utcnow

pytestmark = pytest.mark.e2e
INSTANCE = "i-0123456789abcdef0"
PODS = ("vllm-0", "vllm-1")


def agent_args(kubeconfig: Path, imds_url: str) -> list[str]:
    return [
        *("-m", "spotdrain.cli", "--log-format", "json", "node", "--node-name", "gpu-1", "--imds-url", imds_url),
        *("--imds-interval", "0.1", "--kubeconfig", str(kubeconfig), "--host", "127.0.0.1", "--no-model-cache"),
        *("--metrics-port", str(free_port()), "--notice-port", str(free_port()), "--eviction-delay", "0.2"),
    ]


# Requests let through before the kill: the startup read, the handler's read, the PATCH, the Event, the pod list.
@pytest.mark.parametrize("point", [1, 2, 3, 4, 5], ids=["read", "patch", "event", "pod-list", "eviction"])
async def test_an_agent_killed_mid_notice_and_started_again_finishes_the_drain(tmp_path: Path, point: int) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    async with FakeKube() as kube, serving(imds) as imds_url:
        kube.add_node("gpu-1", provider_id=f"aws:///us-east-1a/{INSTANCE}")
        for pod in PODS:
            kube.add_pod("ml", pod, node="gpu-1", owner_kind="ReplicaSet")
        kube.add_pod("ml", "elsewhere", node="gpu-2", owner_kind="ReplicaSet")

        def containers_exit(pod: dict[str, Any], grace_s: int) -> None:
            asyncio.get_running_loop().call_later(0.2, kube.remove_pod, "ml", pod["metadata"]["name"])

        kube.on_delete(containers_exit)
        args = agent_args(kube.write_kubeconfig(tmp_path / "kubeconfig"), imds_url)
        first = await start(args, log_path=tmp_path / "first.log")
        kube.faults.inject("kill", skip=point, on_strike=first.kill)
        assert await asyncio.wait_for(first.wait(), 15) == -9
        second = await start(args, log_path=tmp_path / "second.log")
        try:
            async with asyncio.timeout(15):
                while any(kube.pod("ml", pod) is not None for pod in PODS):
                    await asyncio.sleep(0.05)
        finally:
            second.kill()
            await second.wait()
        assert kube.pod("ml", "elsewhere") is not None
        assert kube.node("gpu-1")["spec"]["unschedulable"] is True
        assert kube.count("PATCH", "/api/v1/nodes/{name}") == 1, "the node is marked once, across the restart"
    for name in ("first.log", "second.log"):
        events = [json.loads(line)["event"] for line in (tmp_path / name).read_text().splitlines() if line[:1] == "{"]
        assert "task.failed" not in events
