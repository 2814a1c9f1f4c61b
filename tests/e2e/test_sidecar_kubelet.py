"""A pod deleted while its clients keep pooled connections open and a gateway checks its engine's health: the
simulation's kubelet runs the real preStop handshake, sends real signals to the real sidecar, gateway and fake vLLM
processes, and the pod leaves about a second after its last stream, not when the clients' pools let their
connections go (aiohttp 15 s, Envoy an hour)."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import httpx
import pytest

from sidecar.sockdiag import dump
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import engine_args, free_port, sidecar_args, wait_http
from simulate.kubelet import Kubelet, Pod
from simulate.probes import http_probe
from simulate.procs import ProcessGroup
from simulate.timeline import Kind, Recorder

pytestmark = pytest.mark.e2e

HEALTH = b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n"


async def stream_text(session: aiohttp.ClientSession, url: str, max_tokens: int) -> bool:
    """One streamed completion on the session's pool; True if it ended with [DONE]."""
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return (await response.read()).rstrip().endswith(b"data: [DONE]")


async def httpx_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> bool:
    body = {"prompt": "hi", "max_tokens": max_tokens, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        return (await response.aread()).rstrip().endswith(b"data: [DONE]")


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, Kubelet, Recorder, int]]:
    """The fake API with one pod, the simulation's kubelet running its fake vLLM and its real sidecar with default
    poll interval and vLLM's default confirmation window; yields the engine's port once the pod is ready."""
    recorder = Recorder(asyncio.get_running_loop().time)
    procs = ProcessGroup(tmp_path)
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        kube.add_pod("ml", "vllm-0", node="gpu-1", grace_period_s=30)
        kubelet = Kubelet(kube, recorder, namespace="ml")
        kube.on_delete(kubelet.on_delete)
        engine_port, sidecar_port = free_port(), free_port()
        drain_dir = tmp_path / "drain"
        try:
            engine = await procs.start("engine", engine_args(engine_port, "--tokens-per-second", "50"))
            await gateway(procs, engine_port)
            flags = ["--endpoint-delay", "0.3", "--drain-timeout", "30"]
            args = sidecar_args(port=sidecar_port, engine_port=engine_port, drain_dir=drain_dir, extra=flags)
            sidecar = await procs.start("sidecar", args)
            ready = http_probe(f"http://127.0.0.1:{sidecar_port}/ready")
            prestop = ("/bin/sh", str(drain_dir / "prestop"))
            kubelet.adopt(Pod("vllm-0", engine, sidecar, drain_dir, engine_port, readiness=ready, prestop=prestop))
            await wait_http(f"http://127.0.0.1:{sidecar_port}/ready", status=200)
            yield kube, kubelet, recorder, engine_port
        finally:
            await kubelet.close()
            await procs.close()


async def gateway(procs: ProcessGroup, engine_port: int) -> None:
    """``spotdrain gateway`` with the engine as its backend, checking its /health every 0.2 s."""
    port, metrics_port = free_port(), free_port()
    flags = ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)]
    flags += ["--backend", f"http://127.0.0.1:{engine_port}", "--health-interval", "0.2"]
    await procs.start("gateway", ["-m", "spotdrain.cli", "--log-format", "json", "gateway", *flags])
    await wait_http(f"http://127.0.0.1:{port}/health", status=200)


async def delete_pod(kube: FakeKube) -> None:
    context = ssl.create_default_context(cafile=str(kube.ca_path))
    headers = {"Authorization": f"Bearer {kube.token}"}
    async with (
        aiohttp.ClientSession() as session,
        session.delete(f"{kube.url}/api/v1/namespaces/ml/pods/vllm-0", ssl=context, headers=headers) as response,
    ):
        assert response.status == 200, await response.text()


async def test_a_pod_whose_clients_keep_pooled_connections_is_gone_about_a_second_after_its_last_stream(
    tmp_path: Path,
) -> None:
    async with cluster(tmp_path) as (kube, kubelet, recorder, port):
        url = f"http://127.0.0.1:{port}"
        # Opened at the start and held through it all, idle after its one request: as a pool holds one for minutes.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEALTH)
        await reader.readuntil(b"\r\n\r\n")
        async with aiohttp.ClientSession() as pooled, httpx.AsyncClient(timeout=30) as other:
            assert await stream_text(pooled, url, 5), "a first stream leaves its connection in the pool"
            streams = [
                asyncio.create_task(stream_text(pooled, url, 50)),  # 1 s at 50 tokens/s
                asyncio.create_task(stream_text(pooled, url, 100)),
                asyncio.create_task(httpx_stream(other, url, 75)),
            ]
            await asyncio.sleep(0.3)
            await delete_pod(kube)
            assert await asyncio.gather(*streams) == [True, True, True]
            last_stream = recorder.now()
            assert len(dump(port, timeout_s=1)) >= 3, "the pools and the held connection stay open"
            async with asyncio.timeout(10):
                await kubelet.all_gone.wait()
            writer.close()
        removed = recorder.first(Kind.POD_REMOVED)
        prestop = recorder.first(Kind.PRESTOP_RETURNED)
        assert removed is not None
        assert prestop is not None
        assert prestop.at >= last_stream, "the engine's SIGTERM came after its last stream"
        gone_s = removed.at - last_stream
        # Half a second between readings, vLLM's 0.3 s window, the exits: about a second, where pooled connections
        # held it for as long as their pools kept them, and a gateway's health checks for ever.
        assert gone_s < 1.5, f"pod removed {gone_s:.2f} s after its last stream"
