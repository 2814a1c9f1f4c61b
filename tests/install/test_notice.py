"""A Spot interruption notice served by the fake IMDS on the node where the install of test_install.py runs, while
completions stream from its engine pod through the API server's proxy, as a client's would: the agent taints,
cordons and annotates the node, the sidecar takes the pod out of rotation, every open stream ends whole, and the pod
is evicted and gone once the last one has ended, the engine stopping with nothing in flight. Each moment is printed
as a timeline (``pytest -s``). It leaves the node cordoned, so it runs after the install's checks."""

from __future__ import annotations

import re
import subprocess
import time
from datetime import datetime

from tests.install import installing
from tests.install.cases import (
    READ,
    SERVED,
    Completion,
    Moments,
    Poll,
    Watch,
    check_drained_whole,
    parsed,
    serve_notice,
)
from tests.install.conftest import SPOT
from tests.install.node import Cluster
from tests.install.test_install import wait_ready

STREAMS = (250, 300, 350)  # max_tokens of each stream: 5-7 s at the fake engine's 50 tokens/s
NOTICE_AFTER_S = 2.0  # the streams under way when the notice comes
DEADLINE_S = 120  # AWS's two minutes
OUT_OF_ROTATION_TARGET_S = 1.0  # the design's target, from the agent reading the notice
# measured from the notice being served: the agent polls IMDS each second (its default --poll-interval)
OUT_OF_ROTATION_WITHIN_S = 1.0 + OUT_OF_ROTATION_TARGET_S
GONE_TARGET_S = 1.5  # the design's: the pod gone this long after its last stream ended
# twice that, for 2 shared cores: the sidecar's reading of no stream, the kubelet's preStop, SIGTERM, the containers'
# stop and the pod's deletion each take a turn
GONE_WITHIN_S = 2 * GONE_TARGET_S
INTERRUPTION = {"key": "spotdrain.io/interruption", "value": "spot-interruption", "effect": "NoSchedule"}
TIMEOUT_S = 60.0
POLL_S = 0.1


def _field(line: str, index: int) -> str:
    fields = line.split("|")
    return fields[index].strip() if len(fields) > index else ""


def follow(cluster: Cluster, pod: str, container: str) -> subprocess.Popen[str]:
    """The container's log, as it comes, until the pod is gone."""
    command = ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "logs", "-f", "-n", "inference", pod, "-c", container]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def watches(cluster: Cluster, moments: Moments, pod: str) -> list[Watch]:
    """The node, the Service's EndpointSlice and the pod, each watched for the moments the timeline gives."""
    node = ["node", SPOT.name, "-o", 'jsonpath={.spec.unschedulable}|{.spec.taints}{"\\n"}']
    endpoints = ["endpointslices", "-n", "inference", "-l", "kubernetes.io/service-name=vllm", "-o"]
    endpoints.append("jsonpath={range .items[*].endpoints[*]}{.targetRef.name}={.conditions.ready} {end}")
    engine = '{.status.containerStatuses[?(@.name=="vllm")].state.terminated.exitCode}'
    own = ["pod", pod, "-n", "inference", "-o", f'jsonpath={{.metadata.deletionTimestamp}}|{engine}{{"\\n"}}']
    return [
        Watch(
            cluster,
            moments,
            node,
            {"node tainted and cordoned": lambda line: INTERRUPTION["key"] in line and line.startswith("true|")},
        ),
        Poll(cluster, moments, endpoints, {"endpoint ready: false": lambda line: f"{pod}=false" in line}),
        Watch(
            cluster,
            moments,
            own,
            {
                "pod deletion started": lambda line: bool(re.fullmatch(r"\d{4}-.*Z", _field(line, 0))),
                "engine container exited": lambda line: _field(line, 1).isdigit(),
            },
        ),
    ]


def test_a_spot_notice_drains_the_engine_pod_with_every_open_stream_whole(installed: installing.Installed) -> None:
    cluster = installed.cluster
    pod = wait_ready(installed, "inference", "app.kubernetes.io/name=vllm", "vllm pod Ready (for the notice)")
    name = pod["metadata"]["name"]
    moments = Moments("notice")
    logs, sidecar_logs = (follow(cluster, name, container) for container in ("vllm", "spotdrain"))
    watching = watches(cluster, moments, name)
    engine_log = sidecar_log = ""
    try:
        proxy = f"/api/v1/namespaces/inference/pods/{name}:8000/proxy"
        streams = [Completion(cluster, proxy, tokens, moments, n) for n, tokens in enumerate(STREAMS, 1)]
        time.sleep(NOTICE_AFTER_S)
        deadline = serve_notice(cluster, moments, DEADLINE_S)
        for stream in streams:
            stream.thread.join(timeout=TIMEOUT_S + 10)
        gone = ["get", "pod", name, "-n", "inference", "--ignore-not-found", "-o", "name"]
        cluster.wait_for("the pod gone", lambda: not cluster.kubectl(*gone), TIMEOUT_S)
        moments.mark("pod gone")
        engine_log, _ = logs.communicate(timeout=TIMEOUT_S)
        sidecar_log, _ = sidecar_logs.communicate(timeout=TIMEOUT_S)
        node = cluster.get("node", SPOT.name)
    finally:
        for watch in watching:
            watch.stop()
        for following in (logs, sidecar_logs):
            if following.poll() is None:
                following.kill()
                following.communicate(timeout=10)
        print("\n" + "\n".join(moments.lines()))
        # What held the drain, if anything did: the sidecar's judgement of the engine's connections and its drain.
        held = [line for line in sidecar_log.splitlines() if '"engine.connections' in line or '"drain.' in line]
        print("\n".join(f"[sidecar] {line}" for line in held))
        for watch in watching:
            print("\n".join(f"[notice] {at:6.2f} s  {watch.what}: {line}" for at, line in watch.lines))
    seen = moments.seen
    last_stream = max(at for what, at in seen.items() if what.startswith("stream "))
    served, read = seen[SERVED], seen[READ]
    out_of_rotation = seen["endpoint ready: false"] - served
    after_last = seen["pod gone"] - last_stream
    print(
        f"[notice] out of rotation {out_of_rotation:.2f} s after the notice was served, "
        f"{seen['endpoint ready: false'] - read:.2f} s after the agent was seen reading it "
        f"(target {OUT_OF_ROTATION_TARGET_S} s); pod gone {after_last:.2f} s after its last stream ended "
        f"(target {GONE_TARGET_S} s)"
    )

    taints = node["spec"].get("taints", [])
    assert INTERRUPTION in [{k: t.get(k) for k in ("key", "value", "effect")} for t in taints], taints
    assert node["spec"].get("unschedulable") is True
    annotated = node["metadata"]["annotations"].get("spotdrain.io/termination-time", "")
    assert datetime.fromisoformat(annotated.replace("Z", "+00:00")) == deadline, annotated
    assert "node tainted and cordoned" in seen

    assert out_of_rotation <= OUT_OF_ROTATION_WITHIN_S, moments.lines()
    assert seen["endpoint ready: false"] < last_stream, "the notice came after the streams ended: make them longer"
    check_drained_whole(
        streams, seen, [e for e in map(parsed, engine_log.splitlines()) if isinstance(e, dict)], GONE_WITHIN_S
    )
