"""The re-enacted preStop hook and readiness probe of ``simulate --compare``, run for real by every shell an engine
image may have, against a metrics page in vLLM's exact format on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from simulate.baselines import BY_NAME as WAYS
from simulate.baselines import SEED_PRESTOP, SEED_PRESTOP_FIXED, SEED_READINESS, adapted, missing, shell
from simulate.fakes.engine import EngineConfig
from simulate.fakes.engine_metrics import VllmMetrics
from simulate.probes import exec_probe, run_command
from tests.conftest import serving_app

SHELLS = {"dash": ["dash"], "busybox ash": ["busybox", "ash"], "bash": ["bash"]}
SCALE = 0.02  # sleep 15 -> 0.3 s, sleep 2 -> 0.04 s


@pytest.fixture(params=sorted(SHELLS))
def sh(request: pytest.FixtureRequest) -> list[str]:
    argv = SHELLS[request.param]
    found = shutil.which(argv[0])
    if found is None:
        pytest.skip(f"{request.param} is not installed here (Debian: apt-get install {argv[0]})")
    return [found, *argv[1:]]


async def test_the_published_hook_is_rejected_whole_before_it_runs_anything(sh: list[str], tmp_path: Path) -> None:
    script = adapted(SEED_PRESTOP, tmp=tmp_path, engine_port=1, scale=SCALE)
    started = time.monotonic()
    code, error = await run_command([*sh, "-c", script], timeout_s=10)
    assert code == 2
    assert "do" in error, "the shell names the word it did not expect"
    assert time.monotonic() - started < 15 * SCALE, "it fails before its sleep would have ended"
    assert not (tmp_path / "draining").exists(), "not even the touch ran: readiness never flips"


def test_the_hook_runs_here_as_published_but_for_its_directory_port_and_scaled_sleeps(tmp_path: Path) -> None:
    script = adapted(SEED_PRESTOP_FIXED, tmp=tmp_path, engine_port=43210, scale=20 / 120)
    assert "/tmp/draining" not in script
    assert ":8000" not in script
    assert f"touch {tmp_path}/draining; sleep 2.5;" in script
    assert "localhost:43210/metrics" in script
    assert "sleep 0.333;" in script
    assert "$i -lt 45" in script, "still 45 rounds, of a scaled 2 s each"
    assert SEED_PRESTOP.replace("WHILE", "while") == SEED_PRESTOP_FIXED, "the fix is that word alone"


@pytest.mark.skipif(missing(WAYS["seed-prestop-fixed"]) is not None, reason="curl, grep or awk is not installed")
async def test_the_fixed_hook_holds_until_the_engine_reports_no_request_running(sh: list[str], tmp_path: Path) -> None:
    config = EngineConfig()
    metrics = VllmMetrics(config)
    gauge = metrics.running.labels(model_name=config.model, engine="0")
    gauge.set(2)

    async def page(_: web.Request) -> web.Response:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", page)
    async with serving_app(app) as port:
        ready = exec_probe([*sh, "-c", adapted(SEED_READINESS, tmp=tmp_path, engine_port=port, scale=SCALE)])
        async with aiohttp.ClientSession() as session:
            assert (await ready(session))[0] is True
            script = adapted(SEED_PRESTOP_FIXED, tmp=tmp_path, engine_port=port, scale=SCALE)
            hook = asyncio.create_task(run_command([*sh, "-c", script], timeout_s=10))
            await asyncio.sleep(15 * SCALE + 0.3)
            assert not hook.done(), "two requests still run: the hook holds"
            assert (await ready(session))[0] is False, "the touch failed the readiness probe"
            gauge.set(0)
            assert await asyncio.wait_for(hook, 2) == (0, "")


def test_an_exec_hook_or_probe_is_one_sh_line_as_the_pod_spec_writes_it() -> None:
    assert shell("true") == ("/bin/sh", "-c", "true")
