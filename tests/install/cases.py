"""What the cases that interrupt the Spot node share: one clock for what each saw (``Moments``), the API server's
watches and polls and a container's log followed in the background, completions streamed through the API server's
proxy, how often the agent read the notice, and the check that a drain let every stream end whole."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from spotdrain.clock import rfc3339
from tests.install.node import Cluster
from tests.install.reset import imds

TIMEOUT_S = 60.0
POLL_S = 0.1


class Moments:
    """When each thing was first seen, in seconds since the test began (one clock for every thread)."""

    def __init__(self, case: str) -> None:
        self.case = case  # each line's prefix
        self.started = time.monotonic()
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def mark(self, what: str) -> float:
        return self.mark_at(what, time.monotonic() - self.started)

    def mark_at(self, what: str, at: float) -> float:
        with self.lock:
            return self.seen.setdefault(what, at)

    def lines(self) -> list[str]:
        ordered = sorted(self.seen.items(), key=lambda item: item[1])
        return [f"[{self.case}] {at:6.2f} s  {what}" for what, at in ordered]


class Watch:
    """``kubectl get ... -w -o jsonpath=TEMPLATE`` in the background: each line the API server's watch gives, with
    when it came; ``matched`` marks ``what`` at the first line ``test`` accepts."""

    def __init__(self, cluster: Cluster, moments: Moments, args: list[str], marks: dict[str, Any]) -> None:
        argv = ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "get", "-w", *args]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.what = args[0]
        self.moments, self.marks = moments, marks
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._saw(line.rstrip("\n"))

    def _saw(self, line: str) -> None:
        self.lines.append((time.monotonic() - self.moments.started, line))
        for what, test in self.marks.items():
            if test(line):
                self.moments.mark(what)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.thread.join(timeout=10)


class Poll(Watch):
    """The same, asked every ``POLL_S`` (``kubectl get`` without ``-w``): the watch of the EndpointSlice, listed by
    its label, gave no event after its first here."""

    def __init__(self, cluster: Cluster, moments: Moments, args: list[str], marks: dict[str, Any]) -> None:
        self.argv = ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "get", *args]
        self.lines = []
        self.what, self.moments, self.marks = args[0], moments, marks
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        last = None
        while not self.stopped.wait(POLL_S):
            done = subprocess.run(self.argv, capture_output=True, text=True, timeout=TIMEOUT_S)
            line = (done.stdout + done.stderr).strip()
            if line != last:
                self._saw(line)
                last = line

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=TIMEOUT_S)


class Follow(Watch):
    """``kubectl logs -f ARGS`` in the background: each line with when it came, ``marks`` as in Watch."""

    def __init__(self, cluster: Cluster, moments: Moments, args: list[str], marks: dict[str, Any]) -> None:
        argv = ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "logs", "-f", *args]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[tuple[float, str]] = []
        self.what, self.moments, self.marks = f"logs {args[0]}", moments, marks
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def events(self) -> list[dict[str, Any]]:
        """The structured log lines (JSON, as the programs log in a cluster)."""
        return [event for _, line in self.lines if isinstance(event := parsed(line), dict)]


class Completion:
    """One streamed completion asked through the API server's proxy to the pod (``kubectl create --raw``, as
    test_install.py asks one); its answer comes back whole when the stream ends."""

    def __init__(self, cluster: Cluster, proxy: str, max_tokens: int, moments: Moments, number: int) -> None:
        self.max_tokens, self.moments, self.number = max_tokens, moments, number
        request = {"model": "Qwen/Qwen2.5-7B-Instruct", "prompt": "Hello", "max_tokens": max_tokens, "stream": True}
        request["stream_options"] = {"include_usage": True}
        argv = ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "create", "--raw", f"{proxy}/v1/completions"]
        self.process = subprocess.Popen(
            [*argv, "-f", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.answer, self.errors = "", ""
        self.thread = threading.Thread(target=self._wait, args=(json.dumps(request),), daemon=True)
        self.thread.start()

    def _wait(self, request: str) -> None:
        try:
            self.answer, self.errors = self.process.communicate(request, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.answer, self.errors = self.process.communicate()
        self.moments.mark(f"stream {self.number} ended ({self.max_tokens} tokens asked)")

    def chunks(self) -> list[str]:
        return [line.removeprefix("data: ") for line in self.answer.splitlines() if line.startswith("data: ")]

    def tokens(self) -> int:
        usage = [json.loads(chunk).get("usage") for chunk in self.chunks() if chunk != "[DONE]"]
        counted = [u["completion_tokens"] for u in usage if u]
        return int(counted[-1]) if counted else -1


def notice_reads(cluster: Cluster) -> int:
    counts: dict[str, int] = imds(cluster, "request_counts")
    return sum(n for path, n in counts.items() if path.endswith("spot/instance-action"))


SERVED = "notice served"
READ = "the agent read the notice"
DEADLINE = "the notice's deadline"


def serve_notice(cluster: Cluster, moments: Moments, deadline_s: float) -> datetime:
    """A Spot notice (``terminate``) from the Spot node's fake IMDS, its deadline ``deadline_s`` away; marks when it
    was served, its deadline and when the agent read it, and returns the deadline once the agent has read it."""
    read_before = notice_reads(cluster)
    deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=deadline_s)
    imds(cluster, "schedule_spot", action="terminate", time=rfc3339(deadline))
    served = moments.mark(SERVED)
    moments.mark_at(DEADLINE, served + (deadline - datetime.now(UTC)).total_seconds())
    try:
        cluster.wait_for("the agent reading the notice", lambda: notice_reads(cluster) > read_before, TIMEOUT_S)
    except TimeoutError:
        agent = ["logs", "-n", "spotdrain", "daemonset/spotdrain-node", "-c", "agent", "--tail", "40"]
        raise AssertionError(
            f"the agent did not read the notice: IMDS saw {imds(cluster, 'request_counts')}\n"
            + cluster.kubectl(*agent, check=False)
        ) from None
    moments.mark(READ)
    return deadline


def check_drained_whole(
    streams: list[Completion], seen: dict[str, float], engine: list[dict[str, Any]], gone_within_s: float
) -> None:
    """Every stream ended whole, the pod went after the last one (deleted first, gone within ``gone_within_s``), and the
    engine stopped with nothing in flight: its JSON log lines (simulate/fakes/engine.py) say how many streams were
    open when SIGTERM came, and how many it cut."""
    for stream in streams:
        assert stream.chunks()[-1:] == ["[DONE]"], f"stream {stream.number}: {stream.answer[-500:]} {stream.errors}"
        assert stream.tokens() == stream.max_tokens, f"stream {stream.number}: {stream.answer[-500:]}"
    last_stream = max(at for what, at in seen.items() if what.startswith("stream "))
    assert seen["pod deletion started"] < seen["pod gone"]
    assert 0 <= seen["pod gone"] - last_stream <= gone_within_s, seen
    assert seen["engine container exited"] >= last_stream, seen
    by_event = {event.get("event"): event for event in engine}
    assert by_event.get("engine.stopping", {}).get("streams") == 0, engine[-20:]
    assert by_event.get("engine.stopped", {}).get("cut") == 0, engine[-20:]
    assert by_event["engine.stopped"]["completed"] >= len(streams), by_event["engine.stopped"]


def parsed(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None
