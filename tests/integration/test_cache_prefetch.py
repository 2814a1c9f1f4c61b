"""``spotdrain cache prefetch`` against the fake API server and Hugging Face-style mirrors that misbehave: the node's
models land in its cache, its labels follow each one's state, and the startup taint waits for them when asked."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from agent.cache.disks import update_node
from agent.cache.fetch.parts import MANIFEST
from agent.cache.models import MODELS_ANNOTATION
from agent.cache.plan import PENDING_TAINT, READY_LABEL, Outcome
from agent.cache.prefetch import Prefetcher, PrefetchMetrics
from agent.cache.prefetch_settings import PrefetchSettings
from agent.drain.nodes import KubeActions, api_client
from simulate.fakes.kube import FakeKube
from simulate.fakes.mirror import FaultyServer
from simulate.fakes.processes import free_port, wait_http
from spotdrain.metrics import CollectorRegistry, exposition
from spotdrain.ratelimit import RateLimiter
from tests.conftest import serving_app, until

ROOT = Path(__file__).resolve().parents[2]
NODE = "gpu-1"
GPU = {"key": "nvidia.com/gpu", "effect": "NoSchedule"}
PENDING = {"key": PENDING_TAINT, "effect": "NoSchedule"}
FILES = {
    "a": {"config.json": b'{"model_type": "llama"}', "weights.bin": os.urandom(3 * 1024 * 1024 + 7)},
    "b": {"config.json": b'{"model_type": "qwen2"}', "tokenizer.json": b'{"version": "1.0"}'},
}


@pytest.fixture
async def mirrors() -> AsyncIterator[dict[str, tuple[FaultyServer, str]]]:
    """One mirror per model, each serving ``org/NAME`` at revision v1; the value is the model's SOURCE."""
    async with AsyncExitStack() as stack:
        found = {}
        for name, files in FILES.items():
            server = FaultyServer(files=dict(files), repo=f"org/{name}", revision="v1", root="/hub")
            port = await stack.enter_async_context(serving_app(server.app()))
            found[name] = (server, f"hf+http://127.0.0.1:{port}/hub/org/{name}@v1")
        yield found


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir()
    return path


async def cluster(annotation: str | None, *, labels: dict[str, str] | None = None, taints: list[Any]) -> FakeKube:
    kube = FakeKube()
    await kube.start()
    kube.add_node(
        NODE,
        labels={READY_LABEL: "ready"} if labels is None else labels,
        taints=taints,
        annotations={MODELS_ANNOTATION: annotation} if annotation is not None else None,
    )
    return kube


def settings_for(cache: Path, kubeconfig: Path, **changes: Any) -> PrefetchSettings:
    settings = PrefetchSettings(
        node_name=NODE,
        kubeconfig=str(kubeconfig),
        cache_path=cache,
        aws_endpoint_url=None,
        aws_region=None,
        concurrency=4,
        part_size_bytes=1024 * 1024,
        request_timeout_s=1.0,
        wait_for_models=False,
        retry_failed_s=0.2,
        host="127.0.0.1",
        metrics_port=0,
        backoff_s=(0.05, 0.05),
        transient_backoff_s=(0.1,),
    )
    return dataclasses.replace(settings, **changes)


async def prefetch(kube: FakeKube, settings: PrefetchSettings, registry: CollectorRegistry) -> None:
    async with api_client(settings.kubeconfig) as api:
        actions = KubeActions(api, limiter=RateLimiter(qps=100, burst=100), on_error=lambda _: None)
        try:
            await asyncio.wait_for(Prefetcher(settings, actions, PrefetchMetrics.create(registry)).run(), 30)
        finally:
            await actions.close()


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = exposition(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def model_labels(kube: FakeKube) -> dict[str, str]:
    labels = kube.node(NODE)["metadata"].get("labels", {})
    return {key: value for key, value in labels.items() if key.startswith("spotdrain.io/model.")}


async def watch_labels(kube: FakeKube, seen: list[dict[str, str]]) -> None:
    while True:
        labels = model_labels(kube)
        if not seen or seen[-1] != labels:
            seen.append(labels)
        await asyncio.sleep(0.005)


async def test_the_node_s_models_land_whole_and_its_labels_and_metrics_follow_them(
    mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    mirrors["a"][0].chunk_delay_s = 0.01  # long enough to be seen fetching
    annotation = f"a={mirrors['a'][1]}, b={mirrors['b'][1]}"
    kube = await cluster(annotation, taints=[GPU])
    registry = CollectorRegistry()
    seen: list[dict[str, str]] = []
    watcher = asyncio.create_task(watch_labels(kube, seen))
    try:
        await prefetch(kube, settings_for(cache, kube.write_kubeconfig(tmp_path / "kubeconfig")), registry)
        seen.append(model_labels(kube))
    finally:
        watcher.cancel()
        await kube.stop()
    for name, files in FILES.items():
        target = cache / "models" / name
        assert {p.name for p in target.iterdir()} == {*files, MANIFEST}
        assert all((target / path).read_bytes() == data for path, data in files.items())
    assert {"spotdrain.io/model.a": "fetching"} in seen
    assert seen[-1] == {"spotdrain.io/model.a": "ready", "spotdrain.io/model.b": "ready"}
    found = samples(registry)
    total = sum(len(data) for files in FILES.values() for data in files.values())
    assert found[("spotdrain_model_prefetch_bytes", ())] == total
    assert found[("spotdrain_model_prefetch_total_bytes", ())] == total
    assert found[("spotdrain_model_prefetch_models", (("state", "ready"),))] == 2
    assert found[("spotdrain_model_prefetch_models", (("state", "fetching"),))] == 0
    assert found[("spotdrain_model_prefetch_seconds_to_ready", ())] > 0
    assert all(value == 0 for (name, _), value in found.items() if name == "spotdrain_model_prefetch_failures_total")


async def test_a_model_that_fails_for_good_is_labelled_failed_counted_and_tried_again_later(
    mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    server, source = mirrors["b"]
    server.listed_only.add("tokenizer.json")  # listed, then 404: permanent until the mirror is mended
    kube = await cluster(f"b={source}", taints=[GPU])
    registry = CollectorRegistry()

    async def mend_once_failed() -> None:
        while model_labels(kube).get("spotdrain.io/model.b") != "failed":
            await asyncio.sleep(0.01)
        assert samples(registry)[("spotdrain_model_prefetch_failures_total", (("reason", "not_found"),))] == 1
        assert not (cache / "models" / "b").exists()
        server.listed_only.clear()

    try:
        with capture_logs() as logs:
            await asyncio.gather(
                prefetch(kube, settings_for(cache, kube.write_kubeconfig(tmp_path / "kubeconfig")), registry),
                mend_once_failed(),
            )
        assert model_labels(kube) == {"spotdrain.io/model.b": "ready"}
    finally:
        await kube.stop()
    failed = next(log for log in logs if log["event"] == "cache.prefetch_failed")
    assert failed["reason"] == "not_found"
    assert "tokenizer.json" in failed["error"]
    assert (cache / "models" / "b" / "tokenizer.json").read_bytes() == FILES["b"]["tokenizer.json"]


async def test_a_source_that_fails_for_longer_than_the_retries_keeps_the_model_fetching_until_it_is_back(
    mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    server, source = mirrors["a"]
    # weights.bin in one part, tried three times by each fetch: two whole fetches fail, the third gets it.
    server.fail("503", "weights.bin", times=7)
    kube = await cluster(f"a={source}", taints=[GPU])
    registry = CollectorRegistry()
    seen: list[dict[str, str]] = []
    watcher = asyncio.create_task(watch_labels(kube, seen))
    settings = settings_for(cache, kube.write_kubeconfig(tmp_path / "kubeconfig"), part_size_bytes=8 * 1024 * 1024)
    try:
        await prefetch(kube, settings, registry)
        seen.append(model_labels(kube))
    finally:
        watcher.cancel()
        await kube.stop()
    states = [labels.get("spotdrain.io/model.a") for labels in seen if labels]
    assert list(dict.fromkeys(states)) == ["fetching", "ready"]
    assert samples(registry)[("spotdrain_model_prefetch_failures_total", (("reason", "source"),))] == 2
    assert len(server.ranges("weights.bin")) == 8
    assert (cache / "models" / "a" / "weights.bin").read_bytes() == FILES["a"]["weights.bin"]


async def test_with_wait_for_models_the_startup_taint_stays_until_every_model_is_ready(
    mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    kube = await cluster(f"a={mirrors['a'][1]}", labels={}, taints=[GPU, PENDING])
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    try:
        async with api_client(str(kubeconfig)) as api:
            actions = KubeActions(api, limiter=RateLimiter(qps=100, burst=100), on_error=lambda _: None)
            # The cache's init container, with the same flag: the cache is ready, the taint stays.
            assert await update_node(actions, NODE, Outcome.READY, wait_for_models=True)
            await actions.close()
        node = kube.node(NODE)
        assert node["metadata"]["labels"][READY_LABEL] == "ready"
        assert node["spec"]["taints"] == [GPU, PENDING]
        await prefetch(kube, settings_for(cache, kubeconfig, wait_for_models=True), CollectorRegistry())
        node = kube.node(NODE)
    finally:
        await kube.stop()
    assert node["spec"]["taints"] == [GPU]
    assert model_labels(kube) == {"spotdrain.io/model.a": "ready"}


@pytest.mark.parametrize(
    ("annotation", "labels", "event"),
    [
        (None, None, "cache.prefetch_none"),
        ("nothing-here, =s3://b/p/, x=ftp://host/m", None, "cache.prefetch_none"),
        ("a=SOURCE_A", {}, "cache.prefetch_skipped"),  # no cache on the node: nothing lands on its root volume
    ],
)
async def test_a_node_without_models_or_without_a_cache_prefetches_nothing(
    annotation: str | None,
    labels: dict[str, str] | None,
    event: str,
    mirrors: dict[str, tuple[FaultyServer, str]],
    cache: Path,
    tmp_path: Path,
) -> None:
    if annotation is not None:
        annotation = annotation.replace("SOURCE_A", mirrors["a"][1])
    kube = await cluster(annotation, labels=labels, taints=[GPU, PENDING])
    try:
        with capture_logs() as logs:
            settings = settings_for(cache, kube.write_kubeconfig(tmp_path / "kubeconfig"), wait_for_models=True)
            await prefetch(kube, settings, CollectorRegistry())
        node = kube.node(NODE)
    finally:
        await kube.stop()
    assert event in [log["event"] for log in logs]
    assert mirrors["a"][0].requests == []
    assert not (cache / "models").exists()
    assert node["spec"]["taints"] == [GPU, PENDING]  # not this program's to remove: the cache step's
    invalid = [log["problem"] for log in logs if log["event"] == "cache.prefetch_invalid"]
    assert len(invalid) == (3 if annotation and "ftp" in annotation else 0)


async def test_the_command_serves_its_metrics_until_sigterm_and_exits_0(
    mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    kube = await cluster(f"b={mirrors['b'][1]}", taints=[GPU])
    port = free_port()
    command = [
        sys.executable, "-m", "spotdrain.cli", "cache", "prefetch",
        "--node-name", NODE,
        "--kubeconfig", str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "--model-cache-path", str(cache),
        "--host", "127.0.0.1",
        "--metrics-port", str(port),
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=30)
        async with aiohttp.ClientSession() as http:
            for _ in range(300):
                async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                    text = await response.text()
                if 'spotdrain_model_prefetch_models{state="ready"} 1.0' in text:
                    break
                await asyncio.sleep(0.05)
        assert 'spotdrain_model_prefetch_models{state="ready"} 1.0' in text
        # The metric counts the model ready as the label's patch is sent: the label follows within its round trip.
        await until(lambda: model_labels(kube) == {"spotdrain.io/model.b": "ready"}, timeout_s=10)
        process.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(process.communicate(), 10)
    finally:
        if process.returncode is None:
            process.kill()
        await kube.stop()
    stderr = err.decode()
    assert process.returncode == 0, stderr
    events = [json.loads(line).get("event") for line in stderr.splitlines() if line.startswith("{")]
    assert "cache.prefetched" in events


@pytest.mark.parametrize("mended", [True, False])
async def test_once_exits_0_with_the_models_ready_and_1_after_a_failure_retrying_will_not_mend(
    mended: bool, mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    server, source = mirrors["b"]
    if not mended:
        server.listed_only.add("tokenizer.json")
    kube = await cluster(f"b={source}", taints=[GPU])
    command = [
        sys.executable, "-m", "spotdrain.cli", "cache", "prefetch", "--once",
        "--node-name", NODE,
        "--kubeconfig", str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "--model-cache-path", str(cache),
    ]  # fmt: skip
    try:
        process = await asyncio.create_subprocess_exec(
            *command, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
        _, err = await asyncio.wait_for(process.communicate(), 60)
    finally:
        await kube.stop()
    assert process.returncode == (0 if mended else 1), err.decode()
    assert model_labels(kube) == {"spotdrain.io/model.b": "ready" if mended else "failed"}
    assert (cache / "models" / "b").is_dir() == mended


async def test_an_api_server_failing_the_label_patches_for_a_while_still_ends_with_the_model_labelled_ready(
    mirrors: dict[str, tuple[FaultyServer, str]], cache: Path, tmp_path: Path
) -> None:
    kube = await cluster(f"b={mirrors['b'][1]}", taints=[GPU])
    kube.fail_next("GET", r"/api/v1/nodes/gpu-1$", 503, count=2)
    kube.fail_next("PATCH", r"/api/v1/nodes/gpu-1$", 500, count=2)
    try:
        with capture_logs() as logs:
            await prefetch(
                kube, settings_for(cache, kube.write_kubeconfig(tmp_path / "kubeconfig")), CollectorRegistry()
            )
        labels = model_labels(kube)
    finally:
        await kube.stop()
    assert labels == {"spotdrain.io/model.b": "ready"}
    assert any(log["event"] == "api.retry" for log in logs)
    assert (cache / "models" / "b" / "config.json").read_bytes() == FILES["b"]["config.json"]
