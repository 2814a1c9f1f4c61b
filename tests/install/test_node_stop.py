"""A run of the real nodes that is killed outright (SIGKILL: no stop runs) leaves processes, mounts, namespaces,
cgroups, a loop device and a shared host path behind; the next run starts over them and, once stopped, leaves
nothing. Runs after test_node.py's nodes have stopped (a module's fixtures end with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.install import sweep
from tests.install.node import ROOT, STORE, Cluster, Unavailable, missing_reason, spot_node

SHARED = Path("/mnt/spotdrain-e2e-killed-run")
# The killed run: a node with a pod running, the fake IMDS, a loop device and a shared host path.
KILLED_RUN = f"""
import json, sys
from pathlib import Path
from tests.install.node import Cluster, PYTHON_IMAGE, spot_node
cluster = Cluster([spot_node()]).__enter__()
cluster.node(spot_node().name).start_imds()
cluster.attach_loop(1 << 20)
cluster.share(Path("{SHARED}"))
container = {{"name": "c", "image": PYTHON_IMAGE, "command": ["sleep", "600"]}}
toleration = {{"operator": "Exists"}}
spec = {{"containers": [container], "tolerations": [toleration]}}
pod = {{"apiVersion": "v1", "kind": "Pod", "metadata": {{"name": "p"}}, "spec": spec}}
cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
cluster.wait_for("the pod running", lambda: cluster.get("pod", "p")["status"].get("phase") == "Running")
print("up", flush=True)
sys.stdin.read()
"""


def test_a_killed_run_is_swept_by_the_next(tmp_path: Path) -> None:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(f"no real node can run here because {reason}")
    log = tmp_path / "killed.log"
    with log.open("wb") as out:
        killed = subprocess.Popen(
            [sys.executable, "-c", KILLED_RUN], stdin=subprocess.PIPE, stdout=out, stderr=out, cwd=ROOT
        )
    try:
        give_up = time.monotonic() + 120
        while b"up" not in log.read_bytes().split():
            assert killed.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < give_up, log.read_text()[-3000:]
            time.sleep(0.2)
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
    try:
        left = "\n".join(sweep.leftovers(STORE))
        kinds = ["process ", "mount ", "network namespace ", "cgroup ", "loop device ", f"mount {SHARED}"]
        for kind in [*kinds, f"path {SHARED}"]:
            assert kind in left, f"a killed run left no {kind}?\n{left}"
        with Cluster([spot_node()], progress=None) as again:
            assert again.get("node", spot_node().name)["spec"]["providerID"] == spot_node().provider_id
        assert sweep.leftovers(STORE) == []
        assert not SHARED.exists()
    except Unavailable as reason:
        pytest.fail(f"the run after a killed one could not start: {reason}")
    finally:
        sweep.sweep(STORE)  # whatever a failed check above left
        sweep.remove_made_paths(STORE)
