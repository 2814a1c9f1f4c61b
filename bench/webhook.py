"""The webhook process answering AdmissionReviews over TLS: p99 of the POST /mutate round trip for the vLLM pod
deploy/vllm ships (without its sidecar, labelled to be injected), one request at a time on a kept-alive
connection, as the API server sends them (target: p99 under 20 ms); and its resident memory."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench.common import Result, report, rss_mb
from simulate.fakes.processes import free_port, start
from simulate.fakes.tls import write_tls_files
from webhook.admission import LABEL

ROOT = Path(__file__).resolve().parents[1]
TARGET_P99_MS = 20.0
REQUESTS = 1000
WARMUP = 50


def labelled_pod() -> dict[str, Any]:
    """deploy/vllm's pod, with the sidecar and everything inject adds taken off, as a user would write it."""
    deployment = yaml.safe_load((ROOT / "deploy" / "vllm" / "deployment.yaml").read_text())
    template = deployment["spec"]["template"]
    spec = template["spec"]
    spec["containers"] = [c for c in spec["containers"] if c["name"] != "spotdrain"]
    for container in spec["containers"]:
        container.pop("lifecycle", None)
        container["volumeMounts"] = [m for m in container.get("volumeMounts", []) if m["name"] != "spotdrain"]
    spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] not in ("spotdrain", "spotdrain-token")]
    spec.pop("readinessGates", None)
    metadata = {
        "generateName": "vllm-",
        "namespace": "inference",
        "labels": {**template["metadata"]["labels"], LABEL: "true"},
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def review_body(pod: dict[str, Any], uid: int) -> bytes:
    request = {"uid": f"bench-{uid}", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "operation": "CREATE"}
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {**request, "object": pod}}
    return json.dumps(review).encode()


async def _healthy(url: str, context: ssl.SSLContext) -> None:
    async with asyncio.timeout(30), aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url, ssl=context) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.1)


async def measure() -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-webhook-") as directory:
        workdir = Path(directory)
        files = write_tls_files(workdir / "tls")
        port = free_port()
        args = ["-m", "spotdrain.cli", "--log-level", "warning", "webhook", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--tls-cert", str(files.cert_path), "--tls-key", str(files.key_path)]
        process = await start(args, log_path=workdir / "webhook.log")
        try:
            context = ssl.create_default_context(cafile=str(files.ca_path))
            base = f"https://127.0.0.1:{port}"
            await _healthy(base + "/healthz", context)
            pod = labelled_pod()
            timings: list[float] = []
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, ssl=context)) as session:
                for i in range(WARMUP + REQUESTS):
                    body = review_body(pod, i)
                    started = time.perf_counter()
                    async with session.post(
                        base + "/mutate", data=body, headers={"Content-Type": "application/json"}
                    ) as r:
                        answer = await r.json()
                    elapsed_ms = (time.perf_counter() - started) * 1000
                    if "patch" not in answer["response"]:
                        raise RuntimeError(f"the webhook did not inject the benchmark pod: {answer['response']}")
                    if i >= WARMUP:
                        timings.append(elapsed_ms)
            rss = rss_mb(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.wait_for(process.wait(), 15)
    timings.sort()
    p50, p99 = timings[len(timings) // 2], timings[int(len(timings) * 0.99) - 1]
    detail = f"{REQUESTS} requests, {len(body)} byte review, p50 {p50:.2f} ms, max {timings[-1]:.2f} ms"
    return [
        Result.below("webhook_mutate_p99", p99, "ms", TARGET_P99_MS, detail),
        Result.below("webhook_rss", rss, "MB", 80.0, "after the benchmark's requests"),
    ]


if __name__ == "__main__":
    report(asyncio.run(measure()))
