"""The Spot node's agent killed mid-drain, as the OOM killer or a crash kills it: a Spot notice served from the node's
fake IMDS while completions stream from the engine pod, and once the agent has marked the node, written its Event and
evicted the pod (whose sidecar holds it while its streams run), the agent container's main process is sent SIGKILL.
The kubelet restarts the container; the new agent finds the node marked for the notice and marks nothing again (one
taint, one Event, the termination time unchanged), sees the evicted pod terminating and waits until it is gone; every
stream ends whole and the engine stops with nothing in flight. Each moment is printed as a timeline (``pytest -s``).
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from spotdrain.clock import rfc3339
from tests.install import installing, reset, runtime
from tests.install.cases import Completion, Follow, Moments, Watch, check_drained_whole, parsed, serve_notice
from tests.install.conftest import SPOT
from tests.install.node import Cluster
from tests.install.test_install import wait_ready
from tests.install.test_notice import GONE_WITHIN_S, INTERRUPTION

# 14-18 s at the fake engine's 50 tokens/s: the restarted agent (Python's start on 2 shared cores, its first IMDS
# poll) is back while the evicted pod is still held by its streams
STREAMS = (700, 800, 900)
NOTICE_AFTER_S = 2.0  # the streams under way when the notice comes
DEADLINE_S = 120  # AWS's two minutes
KILLED = 128 + signal.SIGKILL  # the exit code the kubelet reports for a process killed by SIGKILL
TIMEOUT_S = 60.0
RESTARTED = "agent container restarted (restartCount up)"
RESUMED = "restarted agent resumed: node already marked"
DRAINED = "restarted agent: node drained"


def agent_pod(cluster: Cluster) -> dict[str, Any]:
    on_spot = f"--field-selector=spec.nodeName={SPOT.name}"
    pods: list[dict[str, Any]] = cluster.get("pods", "-n", "spotdrain", "-l", reset.AGENT, on_spot)["items"]
    assert len(pods) == 1, f"agent pods on {SPOT.name}: {[p['metadata']['name'] for p in pods]}"
    return pods[0]


def agent_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses: list[dict[str, Any]] = pod.get("status", {}).get("containerStatuses", [])
    return next(status for status in statuses if status["name"] == "agent")


def agent_process(cluster: Cluster, pod: dict[str, Any]) -> int:
    """The host pid of the agent container's main process: the task the Spot node's containerd runs for the
    container id the kubelet reports, checked in /proc to run in that container's cgroup, under the pod's."""
    runtime_name, _, container = agent_status(pod)["containerID"].partition("://")
    assert runtime_name == "containerd", runtime_name
    listed = runtime.ctr(cluster.node(SPOT.name).socket, "tasks", "list")  # TASK PID STATUS
    pids = [int(row[1]) for row in map(str.split, listed.splitlines()[1:]) if row[:1] == [container]]
    assert len(pids) == 1, f"containerd's tasks for the agent container {container}:\n{listed}"
    cgroups = Path(f"/proc/{pids[0]}/cgroup").read_text().splitlines()
    in_container = f"/pod{pod['metadata']['uid']}/{container}"
    assert any(line.endswith(in_container) for line in cgroups), f"pid {pids[0]} is not in {in_container}: {cgroups}"
    argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().decode().split("\0")
    # the DaemonSet's command, run by the image's Python
    assert "node" in argv, argv
    assert any(arg.endswith("/spotdrain") for arg in argv), argv
    return pids[0]


def interruption_events(cluster: Cluster, deadline: datetime) -> list[dict[str, Any]]:
    """The node's ``InterruptionNotice`` Events for the notice with ``deadline`` (an earlier case wrote its own)."""
    selector = f"involvedObject.kind=Node,involvedObject.name={SPOT.name},reason=InterruptionNotice"
    items: list[dict[str, Any]] = cluster.get("events", "-n", "default", f"--field-selector={selector}")["items"]
    return [event for event in items if rfc3339(deadline) in event.get("message", "")]


def node_marks(node: dict[str, Any]) -> dict[str, Any]:
    """What the agent put on the node: its taints, the cordon and its annotations."""
    annotations = node["metadata"].get("annotations", {})
    return {
        "taints": [t for t in node["spec"].get("taints", []) if t["key"] == reset.TAINT],
        "unschedulable": node["spec"].get("unschedulable"),
        **{key: annotations.get(key) for key in reset.ANNOTATIONS},
    }


def test_an_agent_killed_mid_drain_comes_back_and_finishes_the_drain(installed: installing.Installed) -> None:
    cluster = installed.cluster
    reset.fresh_spot_node(installed)
    engine_pod = wait_ready(installed, "inference", reset.ENGINE, "vllm pod Ready (for the agent's restart)")
    name, agent = engine_pod["metadata"]["name"], agent_pod(cluster)
    agent_name, restarts = agent["metadata"]["name"], int(agent_status(agent)["restartCount"])
    moments = Moments("agent restart")
    node_template = 'jsonpath={.spec.unschedulable}|{.spec.taints}{"\\n"}'
    exited = '{.status.containerStatuses[?(@.name=="vllm")].state.terminated.exitCode}'
    restarted = '{.status.containerStatuses[?(@.name=="agent")].restartCount}'
    watching = [
        Watch(
            cluster,
            moments,
            ["node", SPOT.name, "-o", node_template],
            {"node tainted and cordoned": lambda line: INTERRUPTION["key"] in line and line.startswith("true|")},
        ),
        Watch(
            cluster,
            moments,
            ["pod", name, "-n", "inference", "-o", f'jsonpath={{.metadata.deletionTimestamp}}|{exited}{{"\\n"}}'],
            {
                "pod deletion started": lambda line: bool(re.match(r"\d{4}-\S*Z\|", line)),
                "engine container exited": lambda line: line.rpartition("|")[2].isdigit(),
            },
        ),
        Watch(
            cluster,
            moments,
            ["pod", agent_name, "-n", "spotdrain", "-o", f'jsonpath={restarted}{{"\\n"}}'],
            {RESTARTED: lambda line: line.strip() == str(restarts + 1)},
        ),
    ]
    engine_log = Follow(cluster, moments, [name, "-n", "inference", "-c", "vllm"], {})
    resumed: Follow | None = None
    try:
        proxy = f"/api/v1/namespaces/inference/pods/{name}:8000/proxy"
        streams = [Completion(cluster, proxy, tokens, moments, n) for n, tokens in enumerate(STREAMS, 1)]
        time.sleep(NOTICE_AFTER_S)
        deadline = serve_notice(cluster, moments, DEADLINE_S)

        def under_way() -> bool:
            # the Event too: posted beside the evictions, a kill before it lands leaves the node without one
            return {"node tainted and cordoned", "pod deletion started"} <= moments.seen.keys() and bool(
                interruption_events(cluster, deadline)
            )

        cluster.wait_for("the node marked, its Event written and the pod evicted", under_way, TIMEOUT_S)
        moments.mark("drain under way: node marked, Event written, pod evicted and held by its sidecar")
        before = node_marks(cluster.get("node", SPOT.name))
        assert not [what for what in moments.seen if what.startswith("stream ")], "streams ended before the kill"
        pid = agent_process(cluster, agent_pod(cluster))
        os.kill(pid, signal.SIGKILL)
        moments.mark(f"agent's main process (host pid {pid}) sent SIGKILL")

        cluster.wait_for("the agent container restarted", lambda: RESTARTED in moments.seen, TIMEOUT_S)
        resumed = Follow(
            cluster,
            moments,
            [agent_name, "-n", "spotdrain", "-c", "agent"],
            {
                "restarted agent up (startup.ready)": lambda line: '"startup.ready"' in line,
                RESUMED: lambda line: '"node.already_marked"' in line,
                "restarted agent saw the pod gone (pod.gone)": lambda line: '"pod.gone"' in line and name in line,
                DRAINED: lambda line: '"node.drained"' in line,
            },
        )
        for stream in streams:
            stream.thread.join(timeout=TIMEOUT_S + 10)
        gone = ["get", "pod", name, "-n", "inference", "--ignore-not-found", "-o", "name"]
        cluster.wait_for("the pod gone", lambda: not cluster.kubectl(*gone), TIMEOUT_S)
        moments.mark("pod gone")
        engine_log.thread.join(timeout=TIMEOUT_S)
        cluster.wait_for("the restarted agent's drain done", lambda: DRAINED in moments.seen, TIMEOUT_S)
        node = cluster.get("node", SPOT.name)
        killed = agent_status(agent_pod(cluster))
        previous = cluster.kubectl("logs", "-n", "spotdrain", agent_name, "-c", "agent", "--previous")
    except BaseException:
        print("\n".join(f"[agent restart] {at:6.2f} s  engine: {line}" for at, line in engine_log.lines[-40:]))
        raise
    finally:
        for watch in [*watching, engine_log, *([resumed] if resumed else [])]:
            watch.stop()
        print("\n" + "\n".join(moments.lines()))
        if resumed is not None:  # what the restarted agent did, its IMDS polls left out
            acted = [(at, line) for at, line in resumed.lines if '"imds.' not in line]
            print("\n".join(f"[agent restart] {at:6.2f} s  restarted agent: {line[:300]}" for at, line in acted))
    assert resumed is not None
    seen = moments.seen

    assert killed["restartCount"] == restarts + 1, killed
    assert killed["lastState"]["terminated"]["exitCode"] == KILLED, killed["lastState"]
    first = [event for line in previous.splitlines() if isinstance(event := parsed(line), dict)]
    assert any(e.get("event") == "pod.evicted" and e.get("pod") == name for e in first), previous[-3000:]
    assert not any(e.get("event") == "node.drained" for e in first), "the first agent finished before the kill"

    after = node_marks(node)
    assert after == before, f"the node's marks changed over the restart: {before} -> {after}"
    assert after["taints"] == [INTERRUPTION], after
    assert after["unschedulable"] is True, after
    assert after["spotdrain.io/termination-time"] == rfc3339(deadline), after
    events = interruption_events(cluster, deadline)
    assert [event.get("count", 1) for event in events] == [1], events

    last_stream = max(at for what, at in seen.items() if what.startswith("stream "))
    assert seen[RESUMED] < last_stream, f"the agent was back after the streams ended: make them longer {seen}"
    again = {str(e.get("event")): e for e in resumed.events()}
    assert again["node.already_marked"]["notice"] == before["spotdrain.io/notice"], again["node.already_marked"]
    assert not {"node.tainted", "node.cordoned", "node.annotated"} & again.keys(), sorted(again)
    draining = again["node.draining"]
    assert draining["evict"] == 0, draining
    assert draining["skipped"].get(f"inference/{name}") == "terminating", draining
    # the node's other pods (test_node.py's, in default) are drained too, each with its own pod.gone
    gone = [e.get("pod") for e in resumed.events() if e.get("event") == "pod.gone"]
    assert f"inference/{name}" in gone, gone
    assert again["node.drained"]["not_evicted"] == [], again["node.drained"]
    check_drained_whole(streams, seen, engine_log.events(), GONE_WITHIN_S)
