"""CPU time to read the in-flight count from a 300 KB vLLM metrics page (target: under 1 ms)."""

from __future__ import annotations

import time

from prometheus_client.exposition import generate_latest

from bench.common import Result, report
from sidecar.engines import ENGINES, in_flight
from simulate.fakes.engine import EngineConfig
from simulate.fakes.engine_metrics import VllmMetrics

TARGET_MS = 1.0


def vllm_page(min_bytes: int = 300_000) -> str:
    """A real-shaped vLLM page: one set of series per data-parallel engine until it reaches ``min_bytes``."""
    engines = 1
    while True:
        page = generate_latest(VllmMetrics(EngineConfig(engines=engines)).registry).decode()
        if len(page) >= min_bytes:
            return page
        engines += 1


def measure(repeats: int = 2000) -> Result:
    page = vllm_page()
    spec = ENGINES["vllm"]
    in_flight(page, spec)
    started = time.process_time()
    for _ in range(repeats):
        in_flight(page, spec)
    per_read_ms = (time.process_time() - started) / repeats * 1000
    return Result.below("inflight_read_cpu", per_read_ms, "ms", TARGET_MS, f"{len(page)} byte page")


if __name__ == "__main__":
    report([measure()])
