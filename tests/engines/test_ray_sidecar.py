"""The real ``spotdrain sidecar --engine ray`` beside real Ray Serve, with the flags and the export interval
deploy/kuberay gives the worker: in-flight read from the node's metrics agent, the preStop held while streams run
through Serve's HTTP proxy and returned soon after the last, and at once on a node where nothing ever ran.

The tests share the module's Ray node and run in this order: the first needs a node that never served a request, the
last ends it as the kubelet ends the Ray container once its preStop returned."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sidecar.engines import ENGINES, RAY_LAG_AT_1000_MS_S, read_engine, sum_samples
from simulate.fakes.processes import status_of, stream
from simulate.ray.server import STEP_S, RayNode
from tests.engines.test_sidecar_vllm import Sidecar, page, running_sidecar

ENDPOINT_DELAY_S = 1.0
# Far shorter than any stream below: a count that holds still between Ray's exports must not end the drain.
STALL_AFTER_S = 3.0
# What the sidecar adds after Ray's page shows the last stream gone: one poll (0.5 s), since a zero read the page's
# lag after the endpoints caught up is believed at once.
RELEASE_S = 0.5
# How late Ray's page shows a stream's end at deploy/kuberay's interval (test_ray_signals measures it).
PAGE_LAG_S = RAY_LAG_AT_1000_MS_S


# Serve's count, as a Ray worker's sidecar reads it at an export each second.
SERVE = ("--engine", "ray", "--zero-confirm", str(RAY_LAG_AT_1000_MS_S))
# vLLM's gauges under Ray with no token counter, as deploy/kuberay read them before --engine ray: a count that
# holds still between exports once ended such a drain as stalled while the streams ran.
VLLM_GAUGES = (
    *("--engine", "custom", "--in-flight-metric", "ray_vllm_num_requests_running,ray_vllm_num_requests_waiting"),
    *("--engine-health-path", "/metrics", "--zero-confirm", str(RAY_LAG_AT_1000_MS_S)),
)


@pytest.fixture
async def sidecar(ray_node: RayNode, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Sidecar]:
    """A sidecar beside the Ray node with the engine flags of ``request.param`` (default: Serve's count), a short
    endpoint delay and a short stall window."""
    flags = [*getattr(request, "param", SERVE), "--drain-timeout", "60"]
    extra = [*flags, "--endpoint-delay", str(ENDPOINT_DELAY_S), "--stall-after", str(STALL_AFTER_S)]
    async with running_sidecar(ray_node.metrics_port, tmp_path, extra) as car:
        yield car


async def prestop(car: Sidecar) -> tuple[asyncio.subprocess.Process, float, float]:
    """Run the preStop as the kubelet does; returns it, when it was run, and how long /ready took to answer 503."""
    hook = await asyncio.create_subprocess_exec("/bin/sh", str(car.drain_dir / "prestop"))
    asked = time.monotonic()
    while (await status_of(f"http://127.0.0.1:{car.port}/ready"))[0] != 503:
        await asyncio.sleep(0.01)
    return hook, asked, time.monotonic() - asked


async def timed_stream(node: RayNode, seconds: float) -> tuple[list[str], float]:
    pieces = await stream(node.http_port, max_tokens=round(seconds / STEP_S))
    return pieces, time.monotonic()


def outcomes(car: Sidecar) -> list[object]:
    return [e["outcome"] for e in car.events() if e["event"] in ("drain.finished", "drain.timeout")]


async def test_a_node_that_never_served_is_released_within_the_endpoint_delay(
    ray_node: RayNode, sidecar: Sidecar
) -> None:
    text = await page(ray_node.metrics_url)
    assert sum_samples(text, "ray_vllm_num_requests_running") is None, "this test needs a node that never served"
    assert sum_samples(text, "ray_serve_replica_processing_queries") == 0
    hook, asked, out_of_rotation_s = await prestop(sidecar)
    await asyncio.wait_for(hook.wait(), 30)
    returned_s = time.monotonic() - asked
    print(f"out of rotation {out_of_rotation_s:.3f} s; preStop returned {returned_s:.2f} s after it ran")
    assert out_of_rotation_s < 1
    assert returned_s < ENDPOINT_DELAY_S + 2, f"the preStop returned {returned_s:.2f} s after it ran"
    assert outcomes(sidecar) == ["drained"]


async def held_streams(node: RayNode, car: Sidecar, seconds: tuple[float, ...]) -> tuple[list[list[str]], float]:
    """Streams of ``seconds`` through Serve, the preStop run 2 s in and held until they end; returns what each
    client got and how long after the last [DONE] the preStop returned."""
    streams = [asyncio.create_task(timed_stream(node, s)) for s in seconds]
    await asyncio.sleep(2)
    hook, _, out_of_rotation_s = await prestop(car)
    finished = await asyncio.gather(*streams)
    last_end = max(end for _, end in finished)
    assert hook.returncode is None, "the preStop held the engine's SIGTERM while the streams ran"
    await asyncio.wait_for(hook.wait(), 30)
    after_s = time.monotonic() - last_end
    print(f"out of rotation {out_of_rotation_s:.3f} s; preStop returned {after_s:.2f} s after the last [DONE]")
    assert out_of_rotation_s < 1
    assert outcomes(car) == ["drained"]
    return [pieces for pieces, _ in finished], after_s


@pytest.mark.parametrize("sidecar", [VLLM_GAUGES], ids=["vllm-gauges"], indirect=True)
async def test_three_streams_are_held_on_vllms_gauges_where_a_token_counter_says_they_run(
    ray_node: RayNode, sidecar: Sidecar
) -> None:
    # 8, 12 and 16 s: each spans many of Ray's exports (1 s) and outlasts the stall window several times over.
    finished, after_s = await held_streams(ray_node, sidecar, (8, 12, 16))
    assert [pieces[-1] for pieces in finished] == ["[DONE]"] * 3
    assert after_s < PAGE_LAG_S + RELEASE_S, f"the preStop returned {after_s:.2f} s after the last [DONE]"


async def test_a_stream_sent_just_before_the_prestop_is_held(ray_node: RayNode, sidecar: Sidecar) -> None:
    # Ray's page shows it only up to 1.5 s later: after the endpoint delay the first readings may still say 0.
    sent = asyncio.create_task(timed_stream(ray_node, 4))
    await asyncio.sleep(0.3)
    hook, _, _ = await prestop(sidecar)
    pieces, end = await sent
    assert pieces[-1] == "[DONE]"
    assert hook.returncode is None, "the preStop held while the stream ran"
    await asyncio.wait_for(hook.wait(), 30)
    after_s = time.monotonic() - end
    print(f"preStop returned {after_s:.2f} s after the stream's [DONE]")
    assert after_s < PAGE_LAG_S + RELEASE_S
    assert outcomes(sidecar) == ["drained"]


async def test_streams_of_20_30_and_40_s_are_held_and_the_kubelets_sigterm_after_the_prestop_cuts_none(
    ray_node: RayNode, sidecar: Sidecar
) -> None:
    finished, after_s = await held_streams(ray_node, sidecar, (20, 30, 40))
    # Every token of each, then [DONE]: nothing was cut while the preStop held.
    assert [len(pieces) for pieces in finished] == [round(s / STEP_S) + 1 for s in (20, 30, 40)]
    assert [pieces[-1] for pieces in finished] == ["[DONE]"] * 3
    assert after_s < PAGE_LAG_S + RELEASE_S, f"the preStop returned {after_s:.2f} s after the last [DONE]"
    # What the kubelet does next: SIGTERM to the container's ray start --block, which ends every open stream at
    # once (test_ray_signals); Ray's own count says none was left to end.
    assert read_engine(await page(ray_node.metrics_url), ENGINES["ray"]).in_flight == 0
    sent = time.monotonic()
    status = await asyncio.to_thread(ray_node.terminate)
    print(f"ray start --block exited {status} {time.monotonic() - sent:.2f} s after SIGTERM")
    assert outcomes(sidecar) == ["drained"]
