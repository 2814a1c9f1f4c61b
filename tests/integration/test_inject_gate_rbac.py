"""The RBAC ``spotdrain inject --readiness-gate`` prints grants exactly the calls a real sidecar's gate makes: a
sidecar run through serving and a whole drain, against the fake API server, needs nothing more and nothing less."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inject.rbac import gate_objects
from simulate.fakes.engine import EngineConfig
from simulate.fakes.kube import FakeKube
from tests.conftest import ask_drain, running_engine
from tests.deploy.manifests import grants, needed
from tests.integration.test_sidecar import sidecar

GATE = "spotdrain.io/serving"


@pytest.fixture
async def kube(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        kube.add_node("gpu-1")
        kube.add_pod("ml", "vllm-0", node="gpu-1", readiness_gates=[GATE])
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        yield kube


def _gate(kube: FakeKube) -> str | None:
    pod = kube.pod("ml", "vllm-0") or {}
    return next((str(c["status"]) for c in pod["status"].get("conditions", []) if c["type"] == GATE), None)


async def test_the_printed_rbac_grants_exactly_what_the_gate_calls(kube: FakeKube, tmp_path: Path) -> None:
    granted = grants(gate_objects([("ml", "vllm")], set()), "ml", "vllm")
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")
    flags = ("--readiness-gate", "--pod-name", "vllm-0", "--pod-namespace", "ml", "--serviceaccount-dir", str(account))
    async with running_engine(EngineConfig()) as engine, sidecar(tmp_path / "run", engine, *flags) as car:
        async with asyncio.timeout(5):
            while _gate(kube) != "True":
                await asyncio.sleep(0.02)
        ask_drain(car.drain_dir)
        await car.wait_drained(10)
        async with asyncio.timeout(5):
            while _gate(kube) != "False":
                await asyncio.sleep(0.02)
    assert needed(kube.calls, granted) == granted
