"""The gateway in front of the benchmark's backend when it drops streams halfway (bench/sse_source.py
``--break-every``): each client still gets the unbroken stream byte for byte, as bench/relay_client.py checks it.
This is what the continued loads of bench/gateway_peers.py measure; every program runs as a process of its own, as
there (importing ``bench`` here would configure logging for the whole test session)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from simulate.fakes.processes import free_port, start, wait_http
from tests.conftest import scrape

ROOT = Path(__file__).resolve().parents[2]
STREAMS = 4
TOKENS = 30


async def tally_of(url: str) -> dict[str, Any]:
    spec = {"url": url, "count": STREAMS, "body": {"max_tokens": TOKENS}, "spread_s": 0.05}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.relay_client", json.dumps(spec), cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0
    tally: dict[str, Any] = json.loads(out)
    return tally


async def test_streams_the_benchmark_backend_drops_halfway_reach_the_client_whole(tmp_path: Path) -> None:
    port, gateway_port, metrics_port = free_port(), free_port(), free_port()
    source = ["-m", "bench.sse_source", "--port", str(port), "--interval", "0.002", "--break-every", "2"]
    backend = await start(source, log_path=tmp_path / "backend.log")
    gateway_argv = ["-m", "spotdrain.cli", "gateway", "--workers", "1", "--backend", f"http://127.0.0.1:{port}"]
    gateway_argv += ["--host", "127.0.0.1", "--port", str(gateway_port), "--metrics-port", str(metrics_port)]
    gateway = await start(gateway_argv, log_path=tmp_path / "gateway.log")
    try:
        await wait_http(f"http://127.0.0.1:{port}/health", status=200)
        await wait_http(f"http://127.0.0.1:{gateway_port}/health", status=200, timeout_s=30)
        tally = await tally_of(f"http://127.0.0.1:{gateway_port}/v1/completions")
        continued = await scrape(f"http://127.0.0.1:{metrics_port}/metrics", "spotdrain_gateway_continuations_total")
    finally:
        for process in (gateway, backend):
            process.kill()
            await process.wait()
    assert (tally["streams"], tally["exact"], tally["faults"]) == (STREAMS, STREAMS, [])
    assert len(tally["latencies_ms"]) == STREAMS * TOKENS
    assert continued == STREAMS // 2  # one stream in two was dropped, and each went on from where it broke
