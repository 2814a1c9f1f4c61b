"""The real ``spotdrain webhook`` process: flags and SPOTDRAIN_* variables, HTTPS with the given certificate, and a
clean exit on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
from pathlib import Path

import aiohttp
import pytest

from simulate.fakes.processes import free_port, start, status_of
from simulate.fakes.tls import write_tls_files
from tests.unit.test_webhook_admission import admission_review, patched, vllm_pod
from webhook.admission import LABEL

pytestmark = pytest.mark.e2e


async def _healthy(url: str, context: ssl.SSLContext, *, timeout_s: float = 20) -> None:
    async with asyncio.timeout(timeout_s), aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url, ssl=context) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)


async def test_the_process_serves_mutate_with_its_flags_and_exits_zero_on_sigterm(tmp_path: Path) -> None:
    files = write_tls_files(tmp_path / "tls")
    port, metrics_port = free_port(), free_port()
    args = ["-m", "spotdrain.cli", "--log-format", "json", "webhook", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--tls-cert", str(files.cert_path), "--drain-timeout", "300", "--metrics-port", str(metrics_port)]
    env = {"SPOTDRAIN_TLS_KEY": str(files.key_path), "SPOTDRAIN_SIDECAR_IMAGE": "registry.local/sidecar:2"}
    process = await start(args, log_path=tmp_path / "webhook.log", env=env)
    try:
        context = ssl.create_default_context(cafile=str(files.ca_path))
        await _healthy(f"https://127.0.0.1:{port}/healthz", context)
        async with aiohttp.ClientSession() as session:
            body = admission_review(vllm_pod({LABEL: "true"}))
            async with session.post(f"https://127.0.0.1:{port}/mutate", data=body, ssl=context) as response:
                answer = json.loads(await response.read())
        sidecar = patched(vllm_pod({LABEL: "true"}), answer)["spec"]["containers"][1]
        assert sidecar["image"] == "registry.local/sidecar:2"
        assert "300" in sidecar["args"]
        status, page = await status_of(f"http://127.0.0.1:{metrics_port}/metrics")  # plain HTTP, its own port
        assert status == 200
        assert 'spotdrain_webhook_admissions_total{outcome="mutated"} 1.0' in page
        assert "spotdrain_webhook_admission_duration_seconds_count 1.0" in page
    finally:
        process.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(process.wait(), 15)
    assert code == 0
    events = [
        json.loads(line)["event"]
        for line in (tmp_path / "webhook.log").read_text().splitlines()
        if line.startswith("{")
    ]
    assert "webhook.admitted" in events


async def test_without_a_certificate_the_process_exits_2_naming_the_flags(tmp_path: Path) -> None:
    process = await start(["-m", "spotdrain.cli", "webhook"], log_path=tmp_path / "webhook.log")
    assert await asyncio.wait_for(process.wait(), 15) == 2
    assert "--tls-cert and --tls-key" in (tmp_path / "webhook.log").read_text()
