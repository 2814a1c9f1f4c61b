"""The real ``spotdrain node`` process against the fake IMDS and API server, stopped with a real SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, start, status_of, wait_http
from spotdrain.clock import utcnow

pytestmark = pytest.mark.e2e
INSTANCE = "i-0123456789abcdef0"


async def test_the_agent_process_acts_on_a_notice_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    async with FakeKube() as kube, serving(imds) as imds_url:
        kube.add_node("gpu-1", provider_id=f"aws:///us-east-1a/{INSTANCE}")
        kube.add_pod("ml", "vllm-0", node="gpu-1", owner_kind="ReplicaSet")

        def containers_exit(pod: dict[str, Any], grace_s: int) -> None:
            asyncio.get_running_loop().call_later(0.2, kube.remove_pod, "ml", "vllm-0")

        kube.on_delete(containers_exit)
        metrics_port, notice_port = free_port(), free_port()
        args = [
            "-m",
            "spotdrain.cli",
            "--log-format",
            "json",
            "node",
            "--node-name",
            "gpu-1",
            "--imds-url",
            imds_url,
            "--kubeconfig",
            str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
            "--host",
            "127.0.0.1",
            "--metrics-port",
            str(metrics_port),
            "--notice-port",
            str(notice_port),
            "--no-model-cache",
        ]
        agent = await start(args, log_path=tmp_path / "agent.log")
        try:
            await wait_http(f"http://127.0.0.1:{metrics_port}/readyz", status=200)
            imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
            async with asyncio.timeout(10):
                while "node.drained" not in (tmp_path / "agent.log").read_text():
                    await asyncio.sleep(0.05)
            assert kube.pod("ml", "vllm-0") is None
            status, body = await status_of(f"http://127.0.0.1:{notice_port}/v1/notice")
            assert status == 200
            assert json.loads(body)["kind"] == "spot-interruption"
            agent.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(agent.wait(), 5) == 0
        finally:
            if agent.returncode is None:
                agent.kill()
                await agent.wait()
    events = [
        json.loads(line)["event"] for line in (tmp_path / "agent.log").read_text().splitlines() if line[:1] == "{"
    ]
    assert events.index("node.cordoned") < events.index("pod.evicted") < events.index("node.drained")
    assert "task.failed" not in events
