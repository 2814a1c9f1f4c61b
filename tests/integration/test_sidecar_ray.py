"""``spotdrain sidecar --engine ray`` in this process beside the fake Ray node (``simulate.fakes.ray``, held to real
Ray by tests/engines/test_ray_signals.py) at deploy/kuberay's export interval: the page lags by up to an export,
Serve's count holds still between exports, and vLLM's and the proxy's series are absent until the first request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from sidecar.engines import RAY_LAG_AT_1000_MS_S
from simulate.fakes.processes import free_port, stream
from simulate.fakes.ray import AGENT_LAG_S, RunningRay, running_ray
from simulate.ray.server import STEP_S
from tests.conftest import ask_drain
from tests.integration.test_sidecar import Sidecar, sidecar

# deploy/kuberay's flags, with a short endpoint delay and a stall window far shorter than the streams.
FLAGS = (
    *("--engine", "ray", "--zero-confirm", str(RAY_LAG_AT_1000_MS_S), "--endpoint-delay", "0.2"),
    *("--stall-after", "1", "--poll-interval", "0.5", "--drain-timeout", "30"),
)
POLL_S = 0.5
EXPORT_S = 1.0


@asynccontextmanager
async def ray_and_sidecar(drain_dir: Path) -> AsyncIterator[tuple[RunningRay, Sidecar]]:
    async with (
        running_ray(free_port(), free_port()) as node,
        sidecar(drain_dir, node.metrics_port, *FLAGS, "--engine-url", node.metrics_url) as car,
    ):
        yield node, car


async def test_a_node_that_never_served_is_released_one_lag_after_the_endpoint_delay(tmp_path: Path) -> None:
    async with ray_and_sidecar(tmp_path) as (_, car):
        asked = time.monotonic()
        ask_drain(tmp_path)
        await car.wait_drained(10)
        released_s = time.monotonic() - asked
        assert await car.metric('spotdrain_sidecar_drains_total{outcome="drained"}') == 1
    # Not held to the drain timeout by vLLM's series, absent on a replica that never served.
    assert released_s < 0.2 + RAY_LAG_AT_1000_MS_S + POLL_S


async def test_streams_whose_count_holds_still_between_exports_are_held_to_their_end(tmp_path: Path) -> None:
    async with ray_and_sidecar(tmp_path) as (node, car):

        async def timed(seconds: float) -> float:
            assert (await stream(node.http_port, max_tokens=round(seconds / STEP_S)))[-1] == "[DONE]"
            assert not (tmp_path / "drained").exists(), "drained while a stream ran"
            return time.monotonic()

        streams = [asyncio.create_task(timed(seconds)) for seconds in (3, 4, 5)]
        await asyncio.sleep(0.5)
        ask_drain(tmp_path)
        last_end = max(await asyncio.gather(*streams))
        await car.wait_drained(10)
        released_s = time.monotonic() - last_end
        assert await car.metric('spotdrain_sidecar_drains_total{outcome="drained"}') == 1
    # The page shows the end by the next export, a moment later; the sidecar believes that zero at its next poll.
    assert released_s < EXPORT_S + AGENT_LAG_S + POLL_S + 0.2
