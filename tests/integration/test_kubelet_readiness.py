"""The simulation's kubelet: a pod's readiness as its endpoint sees it, whatever the pod's own probe says."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from simulate.fakes.kube import FakeKube
from simulate.kubelet import Kubelet, Pod
from simulate.probes import exec_probe
from simulate.procs import ProcessGroup
from simulate.timeline import Recorder


async def test_a_pod_whose_engine_has_exited_is_not_ready_though_its_file_probe_passes(tmp_path: Path) -> None:
    procs = ProcessGroup(tmp_path)
    kubelet = Kubelet(FakeKube(), Recorder(asyncio.get_running_loop().time), namespace="ml")
    try:
        alive = await procs.start("alive", ["-c", "import time; time.sleep(30)"])
        gone = await procs.start("gone", ["-c", "pass"])
        await gone.exited()
        probe = exec_probe(["/bin/sh", "-c", f"test ! -f {tmp_path}/draining"])
        for name, engine in (("vllm-0", alive), ("vllm-1", gone)):
            kubelet.adopt(Pod(name, engine, None, tmp_path, 0, readiness=probe, prestop=None))
        async with aiohttp.ClientSession() as session:
            assert await kubelet.readiness("vllm-0", session) == (
                True,
                f"exec probe `test ! -f {tmp_path}/draining` exits 0",
            )
            assert await kubelet.readiness("vllm-1", session) == (False, "the engine container is not running")
            kubelet.pods["vllm-0"].terminating = True
            ready, why = await kubelet.readiness("vllm-0", session)
            assert (ready, why.split(":")[0]) == (False, "terminating"), "a terminating pod leaves the endpoints"
    finally:
        await kubelet.close()
        await procs.close()
