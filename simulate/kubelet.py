"""The simulation playing the kubelet of its one node: terminating the pods the API deletes, as Kubernetes does.

When a pod's deletion starts (an eviction), the sidecar container gets SIGTERM at once (it has no preStop), the
engine container's preStop runs (spotdrain's ``/bin/sh <drain-dir>/prestop``, or whatever hook the pod spec has, or
none), and the engine gets SIGTERM once the preStop has returned, whether it succeeded or failed: a failed hook is
recorded and the container is stopped all the same (``executePreStopHook`` in
pkg/kubelet/kuberuntime/kuberuntime_container.go logs it and emits a ``FailedPreStopHook`` event). Whatever is left
at the end of the grace period is killed, and the pod is then removed from the API. At the deadline the instance
itself goes: every pod still on it is lost with it.

From its deletion on, a pod's endpoint is not ready whatever its probe says: the EndpointSlice controller marks a
terminating endpoint ``ready: false`` ("Pod termination flow" in the Pod lifecycle docs).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from simulate.fakes.kube import FakeKube
from simulate.fakes.kube_budget import pod_ready
from simulate.probes import Answer, Probe, run_command
from simulate.procs import Proc
from simulate.timeline import Kind, Recorder


@dataclass
class Pod:
    name: str
    engine: Proc
    sidecar: Proc | None  # None: a pod without spotdrain's sidecar
    drain_dir: Path  # the directory its containers share (the sidecar's drain directory, or the engine's /tmp)
    engine_port: int
    readiness: Probe  # the engine container's readinessProbe
    prestop: tuple[str, ...] | None  # the engine container's preStop exec command
    engine_report: dict[str, int] = field(default_factory=dict)  # the engine's own counts from its last log line
    terminating: bool = False
    removed: bool = False

    @property
    def containers(self) -> list[Proc]:
        return [self.engine] if self.sidecar is None else [self.engine, self.sidecar]


class Kubelet:
    def __init__(self, kube: FakeKube, recorder: Recorder, *, namespace: str) -> None:
        self.kube = kube
        self.recorder = recorder
        self.namespace = namespace
        self.pods: dict[str, Pod] = {}
        self.all_gone = asyncio.Event()
        self._timeouts: dict[str, asyncio.Timeout] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def adopt(self, pod: Pod) -> None:
        """Run ``pod`` on this node from now on: its containers' exits are recorded."""
        self.pods[pod.name] = pod
        self._spawn(self._exits(pod), name=f"exits-{pod.name}")

    async def readiness(self, name: str, session: aiohttp.ClientSession) -> Answer:
        """One run of ``name``'s readiness probe, as its endpoint sees it: not ready once the pod is terminating, nor
        while its engine container is not running (a probe that only tests a file would not notice)."""
        pod = self.pods[name]
        if pod.terminating:
            return False, "terminating: its endpoint is no longer ready"
        if not pod.engine.running:
            return False, "the engine container is not running"
        return await pod.readiness(session)

    def probed(self, name: str, ready: bool) -> None:
        """A readiness probe of ``name`` changed its answer: the pod's ContainersReady, and so its Ready condition,
        follow, as its disruption budget sees them. A terminating pod's endpoint left for its deletion, not its
        probe: its condition stays."""
        pod = self.pods.get(name)
        if pod is not None and not pod.removed and not pod.terminating:
            self.kube.set_containers_ready(self.namespace, name, ready)

    def on_delete(self, obj: dict[str, Any], grace_s: int) -> None:
        """The fake API's deletion hook: a pod's deletion started, or its grace period was shortened."""
        pod = self.pods.get(obj["metadata"]["name"])
        if pod is None or pod.removed:
            return
        loop = asyncio.get_running_loop()
        if (running := self._timeouts.get(pod.name)) is not None:
            running.reschedule(min(running.when() or loop.time(), loop.time() + grace_s))
            return
        evicted = any(d.eviction for d in self.kube.deletions if d.name == pod.name)
        how = "evicted" if evicted else "deleted"
        ready = pod_ready(obj)
        text = f"{how} ({'Ready' if ready else 'not Ready'}), grace period {grace_s} s"
        self.recorder.record(Kind.EVICTED, pod.name, text, pod=pod.name, grace_s=grace_s, ready=ready)
        pod.terminating = True
        self._spawn(self._terminate(pod, grace_s), name=f"terminate-{pod.name}")

    async def _terminate(self, pod: Pod, grace_s: int) -> None:
        try:
            async with asyncio.timeout(grace_s) as timeout:
                self._timeouts[pod.name] = timeout
                await self._stop_containers(pod)
        except TimeoutError:
            self.recorder.record(Kind.KILLED, pod.name, "grace period over: SIGKILL to what is left", pod=pod.name)
            await self._kill(pod)
        self._remove(pod)

    async def _stop_containers(self, pod: Pod) -> None:
        if pod.sidecar is not None:
            pod.sidecar.signal(signal.SIGTERM)
        if pod.prestop is not None:
            await self._prestop(pod, pod.prestop)
        pod.engine.signal(signal.SIGTERM)
        await asyncio.gather(*(proc.exited() for proc in pod.containers))

    async def _prestop(self, pod: Pod, command: tuple[str, ...]) -> None:
        """Runs the engine's preStop to its end (the grace period's timeout cancels it) and records how it ended."""
        started = self.recorder.now()
        code, error = await run_command(command, timeout_s=None)
        took = round(self.recorder.now() - started, 3)
        if code == 0:
            text = f"engine preStop returned after {took:.2f} s: SIGTERM to the engine"
        else:
            said = f": {error}" if error else ""
            text = f"engine preStop FAILED (exit {code}{said}) after {took:.2f} s: SIGTERM to the engine all the same"
        self.recorder.record(Kind.PRESTOP_RETURNED, pod.name, text, pod=pod.name, code=code, seconds=took, error=error)

    async def _kill(self, pod: Pod) -> None:
        for proc in pod.containers:
            proc.signal(signal.SIGKILL)
        await asyncio.gather(*(proc.exited() for proc in pod.containers))

    def _remove(self, pod: Pod) -> None:
        if pod.removed:
            return
        with contextlib.suppress(KeyError, LookupError):
            self.kube.remove_pod(self.namespace, pod.name)
        pod.removed = True
        self.recorder.record(Kind.POD_REMOVED, pod.name, "removed from the API", pod=pod.name)
        if all(p.removed for p in self.pods.values()):
            self.all_gone.set()

    async def _exits(self, pod: Pod) -> None:
        """Records each container's exit, however it came."""

        async def engine() -> None:
            code = await pod.engine.exited()
            cut = pod.engine_report.get("cut")
            if cut is not None:
                said = f"; it counted {cut} streams cut"
            else:  # the fake engine logs its count when it exits; a killed one, or real vLLM, says nothing
                said = " (killed: it could not count)" if code < 0 else " (it reports no count)"
            text = f"engine exited (code {code}){said}"
            self.recorder.record(Kind.ENGINE_EXITED, pod.name, text, pod=pod.name, code=code, cut=cut)

        async def sidecar(proc: Proc) -> None:
            code = await proc.exited()
            self.recorder.record(Kind.SIDECAR_EXITED, pod.name, f"sidecar exited (code {code})", pod=pod.name)

        await asyncio.gather(engine(), *([] if pod.sidecar is None else [sidecar(pod.sidecar)]))

    async def reclaim(self) -> None:
        """The instance is gone: every pod still on it dies with it, whatever its state."""
        for pod in self.pods.values():
            if pod.removed:
                continue
            self.recorder.record(Kind.RECLAIMED, pod.name, "still on the instance: lost with it", pod=pod.name)
            await self._kill(pod)
            self._remove(pod)

    def _spawn(self, coro: Coroutine[Any, Any, None], *, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop every termination under way; returns once they have all ended."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
