"""One simulation run, from an empty machine to a verdict: start the cluster, run the load, deliver the notice, watch
the node empty (or the deadline pass), and judge what was recorded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
import structlog

from simulate.baselines import SPOTDRAIN, Way
from simulate.cluster import NODE, STARTUP_S, Cluster, startup_s
from simulate.load import Hops, Load, Unpaced, pace
from simulate.nth import nth_style
from simulate.observe import node_watcher
from simulate.probes import http_probe
from simulate.replacement import Replacement
from simulate.router import Backend, Router
from simulate.scenarios import SCENARIOS, Check, Scenario, judge, stream_seconds
from simulate.settings import SimulationSettings
from simulate.summary import Facts, Summary, summarize
from simulate.timeline import Event, Kind, Recorder, StreamRecord
from spotdrain.clock import rfc3339, utcnow

log = structlog.get_logger()

SETTLE_S = 5.0  # after the node is empty: for the agent to see it, and for the load to hear its last refusals
EVENT_WITHIN_S = 5.0  # from the taint to the node's Event, on a busy machine


@dataclass(frozen=True)
class RunResult:
    scenario: Scenario
    settings: SimulationSettings
    deadline: str  # RFC 3339
    events: tuple[Event, ...]  # in time order
    streams: tuple[StreamRecord, ...]
    summary: Summary
    checks: tuple[Check, ...]  # none for a way other than spotdrain: those are measured, not judged
    way: Way = SPOTDRAIN

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


class _Seen:
    """Which kinds of event have been recorded, so the run can wait for one."""

    def __init__(self) -> None:
        self._flags: dict[Kind, asyncio.Event] = {}

    def flag(self, kind: Kind) -> asyncio.Event:
        return self._flags.setdefault(kind, asyncio.Event())

    def __call__(self, event: Event) -> None:
        self.flag(event.kind).set()


class _Tasks:
    """Background tasks of a run, cancelled when the block ends; a task that failed makes the run fail."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def __aenter__(self) -> _Tasks:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for task in self.tasks:
            task.cancel()
        results = await asyncio.gather(*self.tasks, return_exceptions=True)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures and error is None:
            raise RuntimeError(f"a part of the simulation failed: {failures[0]!r}") from failures[0]


def budget_s(settings: SimulationSettings) -> float:
    """The most a run may take before it is stopped as hung."""
    timings = settings.timings
    return 2 * startup_s(settings) + timings.warmup_s + timings.notice_s + 3 * SETTLE_S


async def simulate(
    settings: SimulationSettings,
    *,
    workdir: Path,
    sink: Callable[[Event], None] | None = None,
    way: Way = SPOTDRAIN,
    ports: set[int] | None = None,
) -> RunResult:
    """Play the scenario once, the notice handled by ``way``; returns what happened and the verdict. ``ports``: those
    given out already, shared by runs side by side. Raises TimeoutError if the run hangs."""
    scenario = SCENARIOS[settings.scenario]
    if scenario.pods is not None:
        settings = dataclasses.replace(settings, pods=scenario.pods)
    seen = _Seen()

    def observe(event: Event) -> None:
        seen(event)
        if sink is not None:
            sink(event)

    recorder = Recorder(asyncio.get_running_loop().time, sink=observe)
    cluster = Cluster(settings, scenario, recorder, workdir=workdir, way=way, ports=ports)
    async with asyncio.timeout(budget_s(settings)):
        deadline, facts = await _play(settings, scenario, recorder, seen, cluster)
    events = tuple(sorted(recorder.events, key=lambda e: e.at))
    pods = [f"vllm-{index}" for index in range(settings.pods)]
    summary = summarize(events, recorder.streams, pods=pods, facts=facts)
    return RunResult(
        scenario=scenario,
        settings=settings,
        deadline=rfc3339(deadline),
        events=events,
        streams=tuple(sorted(recorder.streams, key=lambda s: s.id)),
        summary=summary,
        checks=judge(scenario, summary, gateway=settings.gateway) if way.spotdrain else (),
        way=way,
    )


async def _play(
    settings: SimulationSettings, scenario: Scenario, recorder: Recorder, seen: _Seen, cluster: Cluster
) -> tuple[datetime, Facts]:
    t = settings.timings
    replacement = Replacement(cluster) if scenario.cold_start else None
    async with cluster, _Tasks() as tasks:
        await cluster.start()
        if replacement is not None:
            await replacement.start()
        router, router_url = await _route(cluster, recorder, tasks, poll_s=t.router_poll_s)
        tasks.start(node_watcher(lambda: cluster.kube.node(NODE), recorder, name=NODE), "node-watcher")
        if cluster.way.evicts:
            tasks.start(nth_style(cluster.nth_target(), recorder, scale=t.scale), "nth-style")
        tokens_per_s, paced = await _tokens_per_s(settings, cluster)
        load = _load(settings, scenario, recorder, router_url=router_url, hops=router.hops, tokens_per_s=tokens_per_s)
        load.chats = cluster.chats()  # a scenario of chats: each judged by the message it assembles to
        shape = f"{settings.pods} pods x {settings.streams_per_pod}"
        via = "the gateway and the router" if settings.gateway else "the router"
        text = f"{load.slots} concurrent streams through {via} ({shape}){paced}"
        recorder.record(Kind.LOAD_STARTED, "load", text)
        load_task = tasks.start(load.run(), "load")
        await asyncio.sleep(t.warmup_s)  # a set time of load before the notice, not a wait for anything
        if scenario.lose_node:
            deadline = await cluster.lose_node()
            await _end_load(load, load_task, settings)
            return deadline, Facts(node_patches=cluster.node_patches(), node_events=0, rerouted=router.rerouted)
        deadline = await cluster.deliver_notice()
        deadline_at = recorder.now() + (deadline - utcnow()).total_seconds()
        replaced = tasks.start(replacement.run(), "replacement") if replacement is not None else None
        if scenario.restart_agent:
            tasks.start(_restart_agent(cluster, seen), "agent-restart")
        await _until_empty(cluster, recorder, deadline_at=deadline_at)
        if cluster.way.spotdrain or cluster.way.evicts:
            await _settle(seen.flag(Kind.NODE_DRAINED))
        deleted = await cluster.queue.wait_empty(timeout_s=2 * SETTLE_S) if cluster.queue is not None else None
        if replaced is not None:  # a step that hangs leaves the rest missing from the timeline: the verdict says so
            await asyncio.wait([replaced], timeout=max(STARTUP_S, deadline_at - recorder.now()))
        await _end_load(load, load_task, settings)
        if not recorder.first(Kind.DEADLINE):
            _deadline_ahead(recorder, deadline_at)
        facts = Facts(
            node_patches=cluster.node_patches(),
            node_events=len(cluster.kube.events()),
            rerouted=router.rerouted,
            message_deleted=deleted,
        )
    return deadline, facts


async def _end_load(load: Load, task: asyncio.Task[None], settings: SimulationSettings) -> None:
    """Without the gateway every slot stops at its first refusal, once no pod is left. Through it the other node takes
    the streams over: no new one opens, and those still open are waited for (the longest lasts twice the notice), so
    that each continued stream is judged by how it ended, not left out."""
    if not settings.gateway:
        await asyncio.wait([task], timeout=SETTLE_S)
        return
    load.stopping.set()
    await asyncio.wait([task], timeout=SETTLE_S + 2 * settings.timings.notice_s)


def _deadline_ahead(recorder: Recorder, deadline_at: float) -> None:
    """The run ended before the deadline: put the deadline on the timeline, where it falls."""
    spare = deadline_at - max((e.at for e in recorder.events if e.kind is Kind.POD_REMOVED), default=0.0)
    text = f"the instance would be reclaimed now; its node was empty {spare:.1f} s before"
    recorder.record(Kind.DEADLINE, "deadline", text, at=deadline_at)


async def _route(cluster: Cluster, recorder: Recorder, tasks: _Tasks, *, poll_s: float) -> tuple[Router, str]:
    """Start the router (and the gateway in front of it); returns it and the clients' URL once every pod is in
    rotation."""
    backends = [
        Backend(pod.name, f"http://127.0.0.1:{pod.engine_port}", functools.partial(cluster.kubelet.readiness, pod.name))
        for pod in cluster.kubelet.pods.values()
    ]
    for name, engine_port in cluster.spare_ports.items():
        url = f"http://127.0.0.1:{engine_port}"
        backends.append(Backend(name, url, http_probe(f"{url}/health")))
    router = Router(backends, recorder, poll_s=poll_s, on_change=cluster.kubelet.probed)
    port = cluster.port()
    tasks.start(router.serve(port=port), "router")
    await asyncio.wait_for(router.all_ready.wait(), STARTUP_S)
    url = f"http://127.0.0.1:{port}"
    return router, (await cluster.start_gateway(url) if cluster.settings.gateway else url)


async def _tokens_per_s(settings: SimulationSettings, cluster: Cluster) -> tuple[float, str]:
    """The rate the streams' lengths are reckoned at, and what to say of it. The fake engine streams at
    ``--tokens-per-second``; real vLLM at whatever the machine gives, measured here with as many streams at once as
    the load opens, so that a stream meant to last a few seconds does (a slower machine would otherwise draw streams
    longer than the drain window and call them cut)."""
    if settings.engine != "vllm":
        return settings.tokens_per_s, ""
    urls = [f"http://127.0.0.1:{pod.engine_port}" for pod in cluster.kubelet.pods.values()]
    try:
        measured = await pace(urls, streams=settings.pods * settings.streams_per_pod)
    except (aiohttp.ClientError, TimeoutError, Unpaced) as error:
        log.warning("simulation.pace_unmeasured", error=repr(error))
        return settings.tokens_per_s, ""
    rate = min(settings.tokens_per_s, measured)
    return rate, f"; vLLM gives each {measured:.1f} tokens/s here, lengths reckoned at {rate:.1f}"


def _load(
    settings: SimulationSettings,
    scenario: Scenario,
    recorder: Recorder,
    *,
    router_url: str,
    hops: Hops,
    tokens_per_s: float,
) -> Load:
    rng = random.Random(settings.seed)
    t = settings.timings

    def length_s(slot: int) -> float:
        return stream_seconds(
            scenario.profile, slot=slot, pods=settings.pods, rng=rng, window_s=t.window_s, notice_s=t.notice_s
        )

    slots = settings.pods * settings.streams_per_pod
    return Load(router_url, recorder, slots=slots, length_s=length_s, tokens_per_s=tokens_per_s, hops=hops)


async def _until_empty(cluster: Cluster, recorder: Recorder, *, deadline_at: float) -> None:
    """Returns once every pod has left the node; at the deadline, the instance takes what is left with it."""
    try:
        async with asyncio.timeout(max(0.0, deadline_at - recorder.now())):
            await cluster.kubelet.all_gone.wait()
    except TimeoutError:
        recorder.record(Kind.DEADLINE, "deadline", "the instance is reclaimed", at=deadline_at)
        await cluster.kubelet.reclaim()


async def _settle(flag: asyncio.Event) -> None:
    # The agent notices an empty node on its next look (every 0.5-2 s); a run that ends sooner just lacks the line.
    try:
        async with asyncio.timeout(SETTLE_S):
            await flag.wait()
    except TimeoutError:
        log.warning("simulation.agent_silent", waited_s=SETTLE_S)


async def _restart_agent(cluster: Cluster, seen: _Seen) -> None:
    """Kills the node agent once the notice is out (a pod left rotation) and the node is marked, and starts it
    again; returns then. The sidecars learn of a notice before the node is patched, so a pod out of rotation alone
    would kill the agent before the mark its restart is to find."""
    await seen.flag(Kind.OUT_OF_ROTATION).wait()
    await seen.flag(Kind.TAINTED).wait()
    # The node's Event is posted just after the patch that taints it: killed between the two, a restarted agent finds
    # the node marked and writes none (an Event is for people, not part of the drain). Marked means both here.
    async with asyncio.timeout(EVENT_WITHIN_S):
        while not cluster.kube.events():
            await asyncio.sleep(0.01)
    await cluster.kill_agent()
    await cluster.start_agent()
