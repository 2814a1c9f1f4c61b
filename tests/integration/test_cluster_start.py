"""Starting the simulated cluster's pods: a pod counts as started only once its own engine listens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from simulate.cluster import Cluster
from simulate.scenarios import SCENARIOS
from simulate.settings import SimulationSettings, Timings
from simulate.timeline import Recorder
from tests.conftest import serving_app


async def test_an_engine_whose_port_another_server_took_fails_the_start_rather_than_stand_behind_it(
    tmp_path: Path,
) -> None:
    """Another process may bind the port between our pick and the engine's bind: its answers are not the pod's."""

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="someone else's server")

    app = web.Application()
    app.router.add_get("/health", health)
    settings = SimulationSettings("short-streams", 1, 1, 20.0, 1, Timings.scaled(20))
    cluster = Cluster(settings, SCENARIOS["short-streams"], Recorder(asyncio.get_running_loop().time), workdir=tmp_path)
    async with serving_app(app) as taken:
        try:
            with pytest.raises(RuntimeError, match=f"exited before it listened on port {taken}"):
                await cluster.start_engine("vllm-0", taken)
        finally:
            await cluster.procs.close()
