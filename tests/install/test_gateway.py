"""spotdrain gateway from its own image, installed from deploy/gateway as docs/install.md tells a user, in front of
the engine replicas: one on the Spot node, one kept on the stable node's on-demand GPU (``gatewaying.py``). Streams
asked of the gateway through the API server's service proxy, as a client outside the cluster would, outlive a Spot
notice's deadline: the one on the Spot replica is continued on the stable one, and every client's text, token count
included, equals the same request's uninterrupted text, read from the stable replica at the same time; each stream
ends with ``[DONE]`` and no error. The case's moments are printed as a timeline (``pytest -s``)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from tests.install import gatewaying, installing, reset
from tests.install.cases import DEADLINE, Moments, parsed, serve_notice
from tests.install.conftest import SPOT, STABLE, Images
from tests.install.engine import Podman
from tests.install.gatewaying import Stream
from tests.install.node import Cluster
from tests.install.test_install import wait_ready
from tests.install.test_notice import watches

# 25 s at the fake engine's 50 tokens/s: the notice comes 2 s in, its deadline 20 s later
MAX_TOKENS = 1250
NOTICE_AFTER_S = 2.0
# The gateway moves a stream --migration-margin (15 s) before its node's termination time, the sidecar ends its
# drain 10 s before the deadline at the latest (docs/gateway.md, docs/sidecar.md): both within the stream
DEADLINE_S = 20
GATEWAY_STREAMS = 2  # the first goes to the first backend by address, the Spot one
REQUEST = {"model": "Qwen/Qwen2.5-7B-Instruct", "prompt": "Hello", "max_tokens": MAX_TOKENS, "stream": True}
REQUEST["stream_options"] = {"include_usage": True}
TIMEOUT_S = 60.0


def metrics(cluster: Cluster, pod: str) -> str:
    return str(cluster.kubectl("get", "--raw", f"/api/v1/namespaces/inference/pods/{pod}:9090/proxy/metrics"))


def backends_ready(cluster: Cluster, pod: str) -> float:
    lines = [
        line for line in metrics(cluster, pod).splitlines() if line.startswith("spotdrain_gateway_backends_ready ")
    ]
    return float(lines[0].split()[1]) if lines else 0.0


def continued(cluster: Cluster, gateway: str) -> list[dict[str, Any]]:
    """The gateway's ``gateway.continued`` log events (JSON, as it logs in a cluster). Its workers share the
    container's stderr: each line must be one whole event, none merged with another worker's."""
    lines = cluster.kubectl("logs", "-n", "inference", gateway, "-c", "gateway", check=False).splitlines()
    events = [parsed(line) for line in lines]
    merged = [line for line, event in zip(lines, events, strict=True) if line.startswith("{") and event is None]
    assert not merged, f"log lines that are not one event each: {merged[:3]}"
    return [e for e in events if isinstance(e, dict) and e.get("event") == "gateway.continued"]


def note_splices(moments: Moments, wall: datetime, events: list[dict[str, Any]], streams: list[Stream]) -> None:
    """The gateway's continuations (its log's times, on the wall clock that read ``wall`` at the moments' start)
    and where each client saw its stream spliced."""
    for number, event in enumerate(events, 1):
        at = (datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")) - wall).total_seconds()
        what = f"gateway.continued ({number}) {event['backend']} -> {event['to']} ({event['cause']})"
        moments.mark_at(f"{what}, {event['tokens_sent']} tokens sent", at)
    for stream in streams:
        for at, chunks, cause in stream.splices():
            moments.mark_at(f"{stream.name}: broken after {chunks} chunks, continued after {cause}", at)


def assert_whole(reference: Stream, streams: list[Stream]) -> None:
    """The reference ran uninterrupted to its ``max_tokens``; every gateway stream equals it, text, chunks and
    token count, with one ``[DONE]`` and no error."""
    assert (reference.status, reference.failure) == (200, ""), reference.lines[-5:]
    assert reference.chunks()[-1:] == ["[DONE]"], reference.lines[-5:]
    assert reference.tokens() == MAX_TOKENS, reference.lines[-5:]
    expected = [event["choices"][0]["text"] for event in reference.events() if event.get("choices")]
    for stream in streams:
        assert (stream.status, stream.failure) == (200, ""), stream.name
        assert stream.chunks()[-1:] == ["[DONE]"], (stream.name, stream.lines[-5:])
        assert stream.chunks().count("[DONE]") == 1, stream.name
        assert not [event for event in stream.events() if "error" in event], (stream.name, stream.lines[-5:])
        assert stream.text() == reference.text(), stream.name
        assert stream.tokens() == reference.tokens(), stream.name
        texts = [event["choices"][0]["text"] for event in stream.events() if event.get("choices")]
        assert texts == expected, f"{stream.name}: the client got chunks the uninterrupted stream has not"


def test_a_stream_that_outlives_the_spot_deadline_is_continued_on_the_stable_replica_whole(
    installed: installing.Installed, images: Images, podman: Podman
) -> None:
    cluster = installed.cluster
    reset.fresh_spot_node(installed)
    pod = gatewaying.install(installed, images, podman)
    # the gateway shares the namespace labelled for injection and runs no engine: no sidecar holds it
    assert [container["name"] for container in pod["spec"]["containers"]] == ["gateway"]
    gateway = pod["metadata"]["name"]
    spot = wait_ready(installed, "inference", reset.ENGINE, "vllm pod Ready (for the gateway)")
    assert spot["spec"]["nodeName"] == SPOT.name
    spot_name = spot["metadata"]["name"]
    with gatewaying.on_demand(installed) as stable:
        spot_url, stable_url = (f"http://{pod['status']['podIP']}:8000" for pod in (spot, stable))
        both = "the gateway seeing both replicas ready"
        cluster.wait_for(both, lambda: backends_ready(cluster, gateway) >= 2, TIMEOUT_S)
        installed.timeline.note("the gateway sees both replicas")
        moments, wall = Moments("gateway"), datetime.now(UTC)
        watching = watches(cluster, moments, spot_name)
        try:
            direct = f"/api/v1/namespaces/inference/pods/{stable['metadata']['name']}:8000/proxy"
            reference = Stream(cluster, direct, REQUEST, moments, "reference, direct", kubectl=True).start()
            streams = [
                Stream(cluster, gatewaying.SERVICE_PROXY, REQUEST, moments, f"gateway stream {n}").start()
                for n in range(1, GATEWAY_STREAMS + 1)
            ]
            time.sleep(NOTICE_AFTER_S)
            serve_notice(cluster, moments, DEADLINE_S)
            gone = ["get", "pod", spot_name, "-n", "inference", "--ignore-not-found", "-o", "name"]
            cluster.wait_for("the Spot pod gone", lambda: not cluster.kubectl(*gone), TIMEOUT_S)
            moments.mark("Spot pod gone")
            for stream in [reference, *streams]:
                stream.join()
        finally:
            for watch in watching:
                watch.stop()
        events = continued(cluster, gateway)
        note_splices(moments, wall, events, streams)
        names = {spot_url: spot_name, stable_url: stable["metadata"]["name"]}
        print("\n" + "\n".join(moments.lines()))
        print(f"[gateway] backends: {names}")
    on_stable = ["pods", "-n", "inference", "-l", reset.ENGINE, f"--field-selector=spec.nodeName={STABLE.name}"]
    assert not cluster.get(*on_stable)["items"], "an engine replica left on the stable node for the later cases"

    assert_whole(reference, streams)
    seen = moments.seen
    # the API server's proxy passes each event on as it comes: the clients read theirs long before the notice
    for stream in streams:
        assert seen[f"{stream.name}: first event read by the client"] < seen["notice served"], moments.lines()
    moved = [stream for stream in streams if stream.splices()]
    assert moved, f"no stream was continued: none went to the Spot replica? {events}"
    # moved off the Spot replica --migration-margin before its node's termination time, not cut there
    assert [(e["backend"], e["to"], e["cause"]) for e in events] == [(spot_url, stable_url, "proactive")] * len(moved)
    for stream in moved:
        splice_at = stream.splices()[0][0]
        assert seen["notice served"] < splice_at < seen[DEADLINE], moments.lines()
        assert seen[f"{stream.name}: ended"] > seen[DEADLINE], "the stream ended first: make it longer"
    # the node drained before its deadline while the moved stream went on
    assert seen["endpoint ready: false"] < seen["Spot pod gone"] < seen[DEADLINE], moments.lines()
