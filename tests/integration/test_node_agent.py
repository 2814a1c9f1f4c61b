"""``spotdrain node`` in this process, against the fake IMDS and the fake Kubernetes API on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.drain.kube_config import TOKEN
from agent.drain.planning import ADDED, TAINT_KEY, TERMINATION_TIME
from agent.main import run
from agent.node_settings import from_arguments
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.processes import free_port, status_of
from spotdrain.cli import build_parser
from spotdrain.clock import rfc3339, utcnow
from tests.conftest import Kube, granted_token, node_agent, until
from tests.control_plane import ControlPlane
from tests.deploy.manifests import grants, needed, render
from tests.real_kube import RealKube

INSTANCE = "i-0123456789abcdef0"
GPU_TAINT = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}


@pytest.fixture
async def kube(any_kube: Kube) -> Kube:
    """gpu-1 with two inference pods and two DaemonSet pods, on the fake and on the real API server."""
    any_kube.add_node("gpu-1", provider_id=f"aws:///us-east-1a/{INSTANCE}", taints=[GPU_TAINT])
    any_kube.add_pod("ml", "vllm-0", node="gpu-1", labels={"app": "vllm"}, owner_kind="ReplicaSet", grace_period_s=130)
    any_kube.add_pod("ml", "vllm-1", node="gpu-1", labels={"app": "vllm"}, owner_kind="ReplicaSet", grace_period_s=130)
    any_kube.add_pod("kube-system", "fluent-bit-x", node="gpu-1", owner_kind="DaemonSet")
    any_kube.add_pod("kube-system", "spotdrain-abc", node="gpu-1", owner_kind="DaemonSet")
    any_kube.add_pod("ml", "other-node-pod", node="gpu-2")
    any_kube.on_delete(containers_exit_soon(any_kube))
    return any_kube


def containers_exit_soon(kube: Kube) -> Callable[[dict[str, Any], int], Awaitable[None]]:
    """As the kubelet does once a pod's containers have exited: the pod goes before its grace period ends."""

    async def exit_soon(pod: dict[str, Any], grace_s: int) -> None:
        await asyncio.sleep(min(grace_s, 0.3))
        with contextlib.suppress(KeyError, LookupError):
            kube.remove_pod(pod["metadata"]["namespace"], pod["metadata"]["name"])

    return exit_soon


def agent(
    kube: Kube, imds_url: str, tmp_path: Path, *flags: str, token: str | None = None
) -> AbstractAsyncContextManager[int]:
    """The node agent in IMDS mode for gpu-1, polling the fake IMDS every 0.1 s; yields its notice port."""
    imds = ("--node-name", "gpu-1", "--imds-url", imds_url, "--imds-interval", "0.1")
    return node_agent(kube, tmp_path / "kubeconfig", *imds, *flags, stop_within_s=10, token=token)


def cordoned(kube: Kube) -> bool:
    return bool(kube.node("gpu-1")["spec"].get("unschedulable"))


async def test_a_spot_notice_taints_cordons_publishes_and_evicts(kube: Kube, tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    deadline = utcnow().replace(microsecond=0) + timedelta(seconds=120)
    async with serving(imds) as url, agent(kube, url, tmp_path) as notice_port:
        notice_url = f"http://127.0.0.1:{notice_port}/v1/notice"
        assert (await status_of(notice_url))[0] == 204
        imds.schedule_spot("terminate", deadline)
        await until(lambda: cordoned(kube))
        node = kube.node("gpu-1")
        assert {"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"} in node["spec"]["taints"]
        assert node["metadata"]["annotations"][TERMINATION_TIME] == rfc3339(deadline)
        status, body = await status_of(notice_url)
        assert status == 200
        assert '"kind": "spot-interruption"' in body
        await until(lambda: kube.pod("ml", "vllm-0") is None and kube.pod("ml", "vllm-1") is None)
        assert kube.pod("kube-system", "fluent-bit-x") is not None
        assert kube.pod("ml", "other-node-pod") is not None
        assert all(0 < d.grace_s <= 115 for d in kube.deletions)
        assert [e["reason"] for e in kube.events()] == ["InterruptionNotice"]
        pods_listed = [c for c in kube.calls if c.method == "GET" and c.path == "/api/v1/pods"]
        assert pods_listed
        assert all(c.query.get("fieldSelector") == "spec.nodeName=gpu-1" for c in pods_listed)


async def test_evictions_held_by_a_disruption_budget_go_through_once_it_allows(kube: Kube, tmp_path: Path) -> None:
    kube.add_pdb("ml", "vllm", selector={"app": "vllm"}, min_available=2)
    kube.add_pod("ml", "vllm-2", node="gpu-2", labels={"app": "vllm"}, owner_kind="ReplicaSet")

    async def replace_elsewhere(pod: dict[str, Any], grace_s: int) -> None:
        # The Deployment's replacement becomes Ready on another node a moment after the pod has gone: long enough
        # that the agent's next eviction meets the budget first, also when the real disruption controller counts
        # the replacement at once.
        await asyncio.sleep(1.5)
        kube.add_pod("ml", pod["metadata"]["name"] + "-new", node="gpu-2", labels={"app": "vllm"})

    kube.on_delete(replace_elsewhere)
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    with capture_logs() as logs:
        async with serving(imds) as url, agent(kube, url, tmp_path):
            await until(lambda: len(kube.deletions) == 1)
            await asyncio.sleep(0.3)
            assert len(kube.deletions) == 1, "the budget lets one go at a time"
            await until(lambda: kube.pod("ml", "vllm-0") is None and kube.pod("ml", "vllm-1") is None, timeout_s=15)
    assert any(e["event"] == "pod.eviction_blocked" for e in logs)


async def test_a_restart_mid_drain_resumes_without_marking_twice(kube: Kube, tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    async with serving(imds) as url:
        async with agent(kube, url, tmp_path, "--no-evict"):
            # The Event comes after the cordon: on the real API server it can land after the node is seen cordoned.
            await until(lambda: cordoned(kube) and len(kube.events()) == 1)
        patches = kube.count("PATCH", "/api/v1/nodes/{name}")
        async with agent(kube, url, tmp_path):
            await until(lambda: kube.pod("ml", "vllm-0") is None and kube.pod("ml", "vllm-1") is None)
        assert kube.count("PATCH", "/api/v1/nodes/{name}") == patches == 1
        assert len(kube.events()) == 1


def handled(logs: list[MutableMapping[str, Any]]) -> int:
    """Notices the handler has marked the node for, or found it already marked for."""
    return sum(e["event"] in ("node.tainted", "node.already_marked") for e in logs)


async def test_a_rebalance_after_a_spot_warning_and_a_restart_mark_nothing_more(kube: Kube, tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    with capture_logs() as logs:
        async with serving(imds) as url:
            async with agent(kube, url, tmp_path, "--no-evict"):
                await until(lambda: cordoned(kube))
                imds.schedule_rebalance(utcnow())
                await until(lambda: handled(logs) == 2)
            async with agent(kube, url, tmp_path, "--no-evict"):
                await until(lambda: handled(logs) == 4)
    ours = [t for t in kube.node("gpu-1")["spec"]["taints"] if t["key"] == TAINT_KEY]
    assert ours == [{"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"}]
    assert kube.count("PATCH", "/api/v1/nodes/{name}") == 1
    assert [e["reason"] for e in kube.events()] == ["InterruptionNotice"]


async def test_a_restart_keeps_the_first_deadline_of_an_asg_termination(kube: Kube, tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE, lifecycle_state="Terminated")
    with capture_logs() as logs:
        async with serving(imds) as url:
            async with agent(kube, url, tmp_path, "--no-evict"):
                # The Event comes after the cordon: on the real API server it can land after the node is seen cordoned.
                await until(lambda: cordoned(kube) and len(kube.events()) == 1)
            first = kube.node("gpu-1")["metadata"]["annotations"][TERMINATION_TIME]
            async with agent(kube, url, tmp_path, "--no-evict") as notice_port:
                await until(lambda: handled(logs) == 2)
                status, body = await status_of(f"http://127.0.0.1:{notice_port}/v1/notice")
    assert status == 200
    assert json.loads(body)["deadline"] == first, "the sidecars are told the first deadline, not a later one"
    assert kube.node("gpu-1")["metadata"]["annotations"][TERMINATION_TIME] == first
    assert kube.count("PATCH", "/api/v1/nodes/{name}") == 1
    assert len(kube.events()) == 1


async def test_a_canceled_maintenance_event_removes_only_what_the_agent_added(kube: Kube, tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    imds.add_maintenance(code="system-reboot", event_id="instance-event-0d59937288b749b32",
                         not_before=utcnow() + timedelta(hours=2))  # fmt: skip
    async with serving(imds) as url, agent(kube, url, tmp_path, "--no-evict"):
        await until(lambda: cordoned(kube))
        assert kube.node("gpu-1")["metadata"]["annotations"][ADDED] == "cordon,taint"
        imds.set_maintenance_state("instance-event-0d59937288b749b32", "canceled")
        await until(lambda: not cordoned(kube))
        assert kube.node("gpu-1")["spec"]["taints"] == [GPU_TAINT]
        assert ADDED not in (kube.node("gpu-1")["metadata"].get("annotations") or {})


async def test_api_errors_are_retried_and_counted(kube: Kube, tmp_path: Path) -> None:
    kube.fail_next("PATCH", r"^/api/v1/nodes/gpu-1$", 500, count=2)
    kube.fail_next("POST", r"/eviction$", 429, count=1, retry_after=0.2)
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    async with serving(imds) as url, agent(kube, url, tmp_path, "--metrics-port", str(port := free_port())):
        await until(lambda: kube.pod("ml", "vllm-0") is None and kube.pod("ml", "vllm-1") is None)
        _, page = await status_of(f"http://127.0.0.1:{port}/metrics")
    assert 'spotdrain_api_errors_total{kind="server"} 2.0' in page
    assert 'spotdrain_api_errors_total{kind="throttled"} 1.0' in page
    assert 'spotdrain_notices_total{kind="spot-interruption",source="imds"} 1.0' in page


async def test_a_dry_run_changes_nothing_in_the_cluster(kube: Kube, tmp_path: Path) -> None:
    imds = FakeImds(instance_id=INSTANCE)
    imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
    with capture_logs() as logs:
        async with serving(imds) as url, agent(kube, url, tmp_path, "--dry-run"):
            await until(lambda: any(e["event"] == "node.drained" for e in logs))
    assert not cordoned(kube)
    assert kube.pod("ml", "vllm-0") is not None
    assert kube.events() == []
    assert {c.method for c in kube.calls} == {"GET"}


async def test_a_failed_model_cache_keeps_its_startup_taint_and_notices_are_still_acted_on(
    any_kube: Kube, tmp_path: Path
) -> None:
    pending = {"key": "spotdrain.io/model-cache-pending", "effect": "NoSchedule"}
    kube = any_kube
    kube.add_node("gpu-1", provider_id=f"aws:///us-east-1a/{INSTANCE}", taints=[pending])
    imds = FakeImds(instance_id=INSTANCE)
    flags = ("--no-evict", "--model-cache-devices", str(tmp_path / "gone-nvme1n1"))
    with capture_logs() as logs:
        async with serving(imds) as url, agent(kube, url, tmp_path, *flags):
            await until(lambda: any(e["event"] == "cache.failed" for e in logs))
            imds.schedule_spot("terminate", utcnow() + timedelta(seconds=120))
            await until(lambda: cordoned(kube))
    assert pending in kube.node("gpu-1")["spec"]["taints"]
    failed = next(e for e in logs if e["event"] == "cache.failed")
    assert "gone-nvme1n1" in str(failed["device"])


@pytest.mark.parametrize(
    ("flags", "directory"),
    [
        ((), "daemonset/base"),
        (("--no-evict",), "daemonset/karpenter-interruption"),
        (("--no-evict",), "daemonset/queue-mode"),
    ],
)
async def test_imds_mode_calls_exactly_what_its_account_is_granted(
    kube: Kube, tmp_path: Path, flags: tuple[str, ...], directory: str
) -> None:
    rendered = render(directory)
    granted = grants(rendered, "spotdrain", "spotdrain-node")
    token = granted_token(kube, rendered, "spotdrain", "spotdrain-node")  # the real server: exactly these grants
    imds = FakeImds(instance_id=INSTANCE)
    event_id = imds.add_maintenance(not_before=utcnow() + timedelta(hours=1))
    with capture_logs() as logs:
        async with serving(imds) as url, agent(kube, url, tmp_path, *flags, token=token):
            await until(lambda: cordoned(kube) and len(kube.events()) == 1)
            await until(lambda: "--no-evict" in flags or any(e["event"] == "node.drained" for e in logs))
            imds.set_maintenance_state(event_id, "canceled")
            await until(lambda: len(kube.events()) == 2)
    assert needed(kube.calls, granted) == granted


async def test_outside_a_cluster_without_a_kubeconfig_the_agent_uses_the_home_one_and_says_so(
    kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if TOKEN.exists():
        pytest.skip(f"this machine is a pod ({TOKEN}): its service account would come first")
    for name in ("KUBECONFIG", "SPOTDRAIN_KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".kube").mkdir()
    kubeconfig = kube.write_kubeconfig(tmp_path / ".kube" / "config")
    imds = FakeImds(instance_id=INSTANCE)
    with capture_logs() as logs:
        async with serving(imds) as url:
            argv = ["node", "--node-name", "gpu-1", "--imds-url", url, "--host", "127.0.0.1", "--no-model-cache"]
            argv += ["--metrics-port", str(free_port()), "--notice-port", str(free_port())]
            stop = asyncio.Event()
            task = asyncio.create_task(run(from_arguments(build_parser().parse_args(argv)), stop=stop))
            await until(lambda: task.done() or any(e["event"] == "startup.ready" for e in logs))
            stop.set()
            assert await asyncio.wait_for(task, 10) == 0
    configured = [(e["source"], e["kubeconfig"], e["server"]) for e in logs if e["event"] == "api.configured"]
    assert configured == [("home", str(kubeconfig), kube.url)]


def without(objects: list[dict[str, Any]], grant: tuple[str, str, str, str | None]) -> list[dict[str, Any]]:
    """``objects`` with ``grant``'s verb taken out of the rule that gives it (a rule left with none goes: the API
    server refuses a rule without verbs)."""
    group, resource, verb, _ = grant
    changed = []
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "Role"):
            rules = [
                {**rule, "verbs": [v for v in rule["verbs"] if v != verb]}
                if group in rule["apiGroups"] and resource in rule["resources"]
                else rule
                for rule in obj["rules"]
            ]
            obj = {**obj, "rules": [rule for rule in rules if rule["verbs"]]}
        changed.append(obj)
    return changed


# What daemonset/imds-mode grants the agent (checked against the rendering below; a literal so that collecting
# this module needs no kubectl).
DAEMONSET_GRANTS = [
    ("", "events", "create", "default"),
    ("", "nodes", "get", None),
    ("", "nodes", "patch", None),
    ("", "pods", "list", None),
    ("", "pods/eviction", "create", None),
]


@pytest.mark.parametrize("grant", DAEMONSET_GRANTS, ids=["/".join(g[1:3]) for g in DAEMONSET_GRANTS])
async def test_one_verb_less_than_the_daemonset_is_granted_is_refused_by_the_real_api_server(
    control_plane: ControlPlane, tmp_path: Path, grant: tuple[str, str, str, str | None]
) -> None:
    """The test above runs the agent with exactly its grants on the real server; each one of them is needed: with
    it taken out, the API server refuses the agent's run (a drain on a maintenance notice) for that verb."""
    _, resource, verb, _ = grant
    rendered = render("daemonset/imds-mode")
    assert grants(rendered, "spotdrain", "spotdrain-node") == set(DAEMONSET_GRANTS)
    async with RealKube(control_plane) as real:
        token = granted_token(real, without(rendered, grant), "spotdrain", "spotdrain-node")
        real.add_node("gpu-1", provider_id=f"aws:///us-east-1a/{INSTANCE}", taints=[GPU_TAINT])
        real.add_pod("ml", "vllm-0", node="gpu-1", owner_kind="ReplicaSet", grace_period_s=1)
        imds = FakeImds(instance_id=INSTANCE)
        imds.add_maintenance(not_before=utcnow() + timedelta(hours=1))
        refusal = f'cannot {verb} resource "{resource}"'
        with capture_logs() as logs:
            async with serving(imds) as url, agent(real, url, tmp_path, token=token):
                await until(lambda: any(refusal in str(e.get("error", "")) for e in logs))
        assert any("HTTP 403" in str(e.get("error", "")) for e in logs)
