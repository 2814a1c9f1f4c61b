"""The readiness gate needs the pod's own token: what the sidecar does without one, with one the API server refuses
(401) and with one that may not patch ``pods/status`` (403), and that ``inject --readiness-gate`` gives it one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from structlog.testing import capture_logs

from inject.manifest import inject_text
from inject.rbac import gate_objects
from inject.spec import Options
from simulate.fakes.engine import EngineConfig
from simulate.fakes.kube import FakeKube
from spotdrain.kube_rest import InCluster, patch
from spotdrain.retry import ApiError
from tests.conftest import Kube, ask_drain, running_engine
from tests.deploy.manifests import grants, needed
from tests.deploy.test_inject import VLLM
from tests.integration.test_sidecar import Sidecar, sidecar
from tests.real_kube import RealKube

GATE = "spotdrain.io/serving"
ACCOUNT = "system:serviceaccount:ml:vllm"
STATUS_PATH = "/api/v1/namespaces/ml/pods/vllm-0/status"


@pytest.fixture
async def kube(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        gated_pod(kube, monkeypatch)
        yield kube


@pytest.fixture
def any_gated(any_kube: Kube, monkeypatch: pytest.MonkeyPatch) -> Kube:
    """The pod with the gate, on the fake and on the real API server."""
    return gated_pod(any_kube, monkeypatch)


def gated_pod(kube: Kube, monkeypatch: pytest.MonkeyPatch) -> Kube:
    kube.add_node("gpu-1")
    kube.add_pod("ml", "vllm-0", node="gpu-1", readiness_gates=[GATE])
    for name, value in kube.service_env().items():
        monkeypatch.setenv(name, value)
    return kube


def gate_flags(account: Path) -> tuple[str, ...]:
    return ("--readiness-gate", "--pod-name", "vllm-0", "--pod-namespace", "ml", "--serviceaccount-dir", str(account))


def ready(kube: Kube) -> str:
    pod = kube.pod("ml", "vllm-0") or {}
    return str(next(c["status"] for c in pod["status"]["conditions"] if c["type"] == "Ready"))


async def first(
    logs: Sequence[MutableMapping[str, Any]], event: str, *, timeout_s: float = 5
) -> MutableMapping[str, Any]:
    async with asyncio.timeout(timeout_s):
        while not (found := [e for e in logs if e["event"] == event]):
            await asyncio.sleep(0.02)
    return found[0]


async def settles(car: Sidecar, logs: Sequence[MutableMapping[str, Any]]) -> None:
    """Long enough for a retry loop to show itself (its first backoff steps are 0.2 and 0.5 s)."""
    await asyncio.sleep(1.0)
    assert [e for e in logs if e["event"] == "api.retry"] == []
    assert [e["event"] for e in logs].count("pod.readiness_gate_failed") == 1
    assert await car.ready() == 200, "the sidecar itself keeps serving; the pod stays un-Ready through its gate"
    assert not car.task.done()


# The fake API's side ------------------------------------------------------------------------------------------------


async def test_the_fake_refuses_an_unknown_token_and_a_token_without_the_permission(
    kube: FakeKube, tmp_path: Path
) -> None:
    body = {"status": {"conditions": [{"type": GATE, "status": "True"}]}}
    allowed = kube.issue_token(ACCOUNT)
    denied = kube.issue_token(ACCOUNT, denied=[("patch", "pods/status")])
    answers = {}
    async with aiohttp.ClientSession() as session:
        for name, token in (("forged", "forged"), ("denied", denied), ("allowed", allowed)):
            directory = kube.serviceaccount_dir(tmp_path / name, namespace="ml", token=token)
            try:
                await patch(session, InCluster.from_environment(directory), STATUS_PATH, body)
                answers[name] = "200"
            except ApiError as error:
                answers[name] = str(error)
    forbidden = (
        'HTTP 403: pods "vllm-0" is forbidden: User "system:serviceaccount:ml:vllm" cannot patch resource '
        '"pods/status" in API group "" in the namespace "ml"'
    )
    assert answers == {"forged": "HTTP 401: Unauthorized", "denied": forbidden, "allowed": "200"}
    assert ready(kube) == "True"


# The sidecar's side -------------------------------------------------------------------------------------------------


async def test_no_token_mounted_is_an_error_at_start_counted_once_and_never_retried(
    kube: FakeKube, tmp_path: Path
) -> None:
    empty = tmp_path / "serviceaccount"
    empty.mkdir()
    with capture_logs() as logs:
        async with (
            running_engine(EngineConfig()) as engine,
            sidecar(tmp_path / "run", engine, *gate_flags(empty)) as car,
        ):
            failed = await first(logs, "pod.readiness_gate_failed", timeout_s=2)
            assert failed["log_level"] == "error"
            assert (failed["kind"], str(empty / "token") in failed["error"]) == ("no_token", True)
            assert "inject --readiness-gate" in failed["needs"]
            await settles(car, logs)
            assert await car.metric('spotdrain_sidecar_readiness_gate_errors_total{kind="no_token"}') == 1
    assert kube.count("PATCH", "/api/v1/namespaces/{namespace}/pods/{name}/status") == 0
    assert ready(kube) == "False"


@pytest.mark.parametrize(
    ("denied", "kind", "said"),
    [
        (None, "unauthorized", "HTTP 401: Unauthorized"),
        ([("patch", "pods/status")], "forbidden", 'cannot patch resource "pods/status"'),
    ],
)
async def test_a_token_refused_or_without_the_permission_is_an_error_at_start_counted_once(
    kube: FakeKube, tmp_path: Path, denied: list[tuple[str, str]] | None, kind: str, said: str
) -> None:
    token = "forged" if denied is None else kube.issue_token(ACCOUNT, denied=denied)
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml", token=token)
    with capture_logs() as logs:
        async with (
            running_engine(EngineConfig()) as engine,
            sidecar(tmp_path / "run", engine, *gate_flags(account)) as car,
        ):
            failed = await first(logs, "pod.readiness_gate_failed", timeout_s=2)
            assert (failed["log_level"], failed["kind"], said in failed["error"]) == ("error", kind, True)
            await settles(car, logs)
            assert await car.metric(f'spotdrain_sidecar_readiness_gate_errors_total{{kind="{kind}"}}') == 1
            ask_drain(car.drain_dir)
            await car.wait_drained(5)
    assert kube.count("PATCH", "/api/v1/namespaces/{namespace}/pods/{name}/status") == 1, "not patched again"
    assert ready(kube) == "False"


def projected(volume: dict[str, Any], directory: Path, *, kube: Kube, token: str, namespace: str) -> Path:
    """What the kubelet writes for a projected volume of these three sources, into ``directory``."""
    directory.mkdir()
    for source in volume["projected"]["sources"]:
        if "serviceAccountToken" in source:
            (directory / source["serviceAccountToken"]["path"]).write_text(token)
        elif source.get("configMap", {}).get("name") == "kube-root-ca.crt":
            [item] = source["configMap"]["items"]
            (directory / item["path"]).write_bytes(kube.ca_path.read_bytes())
        else:
            [item] = source["downwardAPI"]["items"]
            assert item["fieldRef"]["fieldPath"] == "metadata.namespace"
            (directory / item["path"]).write_text(namespace)
    return directory


async def test_an_injected_pod_with_the_gate_becomes_ready_with_its_own_token(any_gated: Kube, tmp_path: Path) -> None:
    kube = any_gated
    spec = yaml.safe_load(inject_text(VLLM, Options(readiness_gate=True)).text)["spec"]["template"]["spec"]
    sidecar_spec = next(c for c in spec["containers"] if c["name"] == "spotdrain")
    [mount] = [m for m in sidecar_spec["volumeMounts"] if m["mountPath"].endswith("serviceaccount")]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    token = kube.issue_token(ACCOUNT, denied=[("patch", "pods")])  # what deploy/vllm/rbac.yaml grants: status only
    account = projected(volume, tmp_path / "sa", kube=kube, token=token, namespace="ml")
    flags = ("--readiness-gate", "--pod-name", "vllm-0", "--serviceaccount-dir", str(account))  # namespace from it
    assert mount["mountPath"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    async with running_engine(EngineConfig()) as engine, sidecar(tmp_path / "run", engine, *flags) as car:
        async with asyncio.timeout(5):
            while ready(kube) != "True":
                await asyncio.sleep(0.02)
        assert await car.metric("spotdrain_sidecar_readiness_gate_errors_total") == 0


def gate_status(kube: Kube) -> str | None:
    pod = kube.pod("ml", "vllm-0") or {}
    return next((str(c["status"]) for c in pod["status"].get("conditions", []) if c["type"] == GATE), None)


async def test_the_printed_rbac_grants_exactly_what_the_gate_calls(any_gated: Kube, tmp_path: Path) -> None:
    """The RBAC ``spotdrain inject --readiness-gate`` prints is exactly what a real sidecar's gate calls need, through
    serving and a whole drain: nothing more and nothing less."""
    kube = any_gated
    printed = gate_objects([("ml", "vllm")], set())
    granted = grants(printed, "ml", "vllm")
    # On the real API server the sidecar holds a token of exactly the printed grants; the fake's may do anything.
    token = kube.apply_and_token(printed, "ml", "vllm") if isinstance(kube, RealKube) else None
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml", token=token)
    async with running_engine(EngineConfig()) as engine, sidecar(tmp_path / "run", engine, *gate_flags(account)) as car:
        async with asyncio.timeout(5):
            while gate_status(kube) != "True":
                await asyncio.sleep(0.02)
        ask_drain(car.drain_dir)
        await car.wait_drained(10)
        async with asyncio.timeout(5):
            while gate_status(kube) != "False":
                await asyncio.sleep(0.02)
    assert needed(kube.calls, granted) == granted
