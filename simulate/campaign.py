"""A fault campaign: many interruptions of the node agent, each with one random fault at a random point, each checked.

Each run is a Spot interruption of a node of its own, in a fake cluster it shares with the runs before it: their nodes,
and a bystander node with pods of its own, are what must not be touched. The agent runs in this process as
``spotdrain node`` does (``agent.main.run``), against the fake API server and the fake IMDS, or in queue mode
against moto's SQS. One fault per run, at a random point (the number of API requests let through before it):

- ``hang``, ``drop``, ``garbage``: an API request never answered, its connection closed, or a 200 that is not JSON,
  each acted on by the API first or not;
- ``server-error``, ``conflict``, ``throttled``: 5xx on one to three requests, a 409, a 429 with Retry-After;
- ``imds-outage``: IMDS answers 500 or 503 to its next requests; ``imds-token``: every token is refused (401) and the
  next token requests fail, or are answered for a while with an HTML page, as by a captive proxy;
- ``agent-restart``: when the chosen request arrives the agent is killed (its tasks cancelled: nothing it would do
  next happens) and a new one starts over the same cluster, as the kubelet restarts a container.

Checked for every run: the node tainted, cordoned and annotated with the deadline and every evictable pod evicted,
before the deadline; no other node, nor any pod of another node, touched; in queue mode the message deleted exactly
once, after the last pod went; the agent running until told to stop, then exiting 0.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from simulate.campaign_tally import IMDS_FAULTS, Outcome, Plan, Tally
from simulate.fakes.aws import REGION, MotoServer
from simulate.fakes.events import spot_warning
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.kube_resources import NODES
from spotdrain.clock import rfc3339, utcnow

DEADLINE_S = 20  # from the notice: every run must be done well inside it
API_TIMEOUT_S = 0.5
TAINT_KEY, TERMINATION_TIME = "spotdrain.io/interruption", "spotdrain.io/termination-time"


class Agent:
    """``spotdrain node`` in this loop; ``kill`` ends it where it is and starts a new one, as a restart does."""

    def __init__(self, argv: list[str]) -> None:
        from agent.node_settings import from_arguments
        from spotdrain.cli import build_parser

        self.settings = from_arguments(build_parser().parse_args(argv))
        self.stop = asyncio.Event()
        self.task: asyncio.Task[int] | None = None
        self.kills = 0
        self._restart: asyncio.Task[None] | None = None

    def start(self) -> None:
        from agent.main import run

        self.stop = asyncio.Event()
        self.task = asyncio.create_task(run(self.settings, stop=self.stop))

    def kill(self) -> None:
        assert self.task is not None
        self.kills += 1
        self.task.cancel()
        self._restart = asyncio.create_task(self._start_after(self.task))

    async def _start_after(self, old: asyncio.Task[int]) -> None:
        await asyncio.wait([old])
        self.start()

    def exited(self) -> bool:
        """Ended without being told to: the one thing an agent must never do."""
        running = self._restart is not None and not self._restart.done()
        return not running and self.task is not None and self.task.done() and not self.stop.is_set()

    async def close(self) -> int:
        """Tell the agent to stop; its exit code (-1: it had been cancelled without a restart)."""
        if self._restart is not None:
            await self._restart
        assert self.task is not None
        self.stop.set()
        await asyncio.wait([self.task], timeout=10)
        return -1 if not self.task.done() or self.task.cancelled() else self.task.result()


class Cluster:
    """One fake API server and what one worker's runs left in it, with a bystander node that must stay untouched."""

    def __init__(self, kube: FakeKube, kubeconfig: Path) -> None:
        self.kube = kube
        self.kubeconfig = kubeconfig
        self.removed_at: dict[str, float] = {}  # namespace/name -> when the pod went
        kube.add_node("bystander", provider_id="aws:///us-east-1a/i-0bystander0000000")
        for i in range(2):
            kube.add_pod("ml", f"bystander-{i}", node="bystander", owner_kind="ReplicaSet")
        kube.on_delete(self._containers_exit_soon)

    async def _containers_exit_soon(self, pod: dict[str, Any], grace_s: int) -> None:
        # As the kubelet does once the containers have exited: the pod goes before its grace period ends.
        await asyncio.sleep(min(grace_s, 0.05))
        meta = pod["metadata"]
        if self.kube.pod(meta["namespace"], meta["name"]) is not None:
            self.kube.remove_pod(meta["namespace"], meta["name"])
            self.removed_at[f"{meta['namespace']}/{meta['name']}"] = time.monotonic()


@dataclass
class Run:
    """What one run set up, and what it must find at its end."""

    plan: Plan
    cluster: Cluster
    node: str
    deadline: datetime
    pods: list[str]
    others: dict[str, str]  # other nodes -> resourceVersion before the run
    calls_from: int
    deletions_from: int

    @classmethod
    def prepare(cls, plan: Plan, cluster: Cluster) -> Run:
        kube, node = cluster.kube, f"node-{plan.number}"
        kube.faults.clear()
        others = {n["metadata"]["name"]: n["metadata"]["resourceVersion"] for n in kube.store.items(NODES)}
        kube.add_node(node, provider_id=f"aws:///us-east-1a/{instance_of(plan)}")
        pods = [f"vllm-{plan.number}-{i}" for i in range(2)]
        for pod in pods:
            kube.add_pod("ml", pod, node=node, owner_kind="ReplicaSet", grace_period_s=30)
        kube.add_pod("kube-system", f"daemon-{plan.number}", node=node, owner_kind="DaemonSet")
        deadline = utcnow().replace(microsecond=0) + timedelta(seconds=DEADLINE_S)
        return cls(plan, cluster, node, deadline, pods, others, len(kube.calls), len(kube.deletions))

    def done(self) -> bool:
        node = self.cluster.kube.node(self.node)
        taints = node["spec"].get("taints") or []
        marked = (
            bool(node["spec"].get("unschedulable"))
            and {"key": TAINT_KEY, "value": "spot-interruption", "effect": "NoSchedule"} in taints
            and (node["metadata"].get("annotations") or {}).get(TERMINATION_TIME) == rfc3339(self.deadline)
        )
        return marked and all(self.cluster.kube.pod("ml", pod) is None for pod in self.pods)

    def intruded(self) -> list[str]:
        """What the run did to anything but its own node and pods."""
        kube = self.cluster.kube
        found = [
            f"node {name} changed"
            for name, version in self.others.items()
            if kube.node(name)["metadata"]["resourceVersion"] != version
        ]
        deleted = kube.deletions[self.deletions_from :]
        found += [f"pod {d.namespace}/{d.name} deleted" for d in deleted if not self._own(d.name)]
        for call in kube.calls[self.calls_from :]:
            if call.method != "GET" and not call.path.startswith("/api/v1/namespaces/default/events"):
                target = call.path.rstrip("/").split("/")
                if not (self.node in target or any(self._own(part) for part in target)):
                    found.append(f"{call.method} {call.path}")
        return found

    def _own(self, name: str) -> bool:
        return name == self.node or name in self.pods


def instance_of(plan: Plan) -> str:
    return f"i-{plan.number:017x}"


def agent_argv(run: Run, *, imds_url: str | None, queue_url: str | None, moto: MotoServer | None) -> list[str]:
    argv = ["node", "--kubeconfig", str(run.cluster.kubeconfig), "--host", "127.0.0.1", "--metrics-port", "0"]
    argv += ["--notice-port", "0", "--eviction-delay", "0", "--api-timeout", str(API_TIMEOUT_S), "--no-model-cache"]
    if queue_url is not None:
        assert moto is not None
        argv += ["--queue-url", queue_url, "--aws-region", REGION, "--aws-endpoint-url", moto.endpoint_url]
        return [*argv, "--sqs-wait-time", "1"]
    assert imds_url is not None
    return [*argv, "--node-name", run.node, "--imds-url", imds_url, "--imds-interval", "0.05"]


def inject(plan: Plan, kube: FakeKube, imds: FakeImds, agent: Agent) -> None:
    if plan.fault == "imds-outage":
        imds.fail_next("*", plan.status if plan.status in (500, 503) else 503, count=plan.count)
    elif plan.fault == "imds-token":
        imds.expire_tokens()
        if plan.variant:  # a captive proxy answers the token request for a while
            imds.answer_tokens_with("<html><body><form>Sign in to continue</form></body></html>\n")
            asyncio.get_running_loop().call_later(0.1 * plan.count, imds.answer_tokens_with, None)
        else:
            imds.fail_next("/latest/api/token", 500, count=plan.count)
    elif plan.fault == "agent-restart":
        kube.faults.inject("kill", skip=plan.point, on_strike=agent.kill)
    elif plan.fault in ("server-error", "conflict", "throttled"):
        retry_after = float(plan.variant) if plan.fault == "throttled" else None
        kube.faults.inject("status", skip=plan.point, count=plan.count, status=plan.status, retry_after_s=retry_after)
    else:
        kube.faults.inject(plan.fault, skip=plan.point, applied=plan.applied, garbage=plan.variant)


async def run_once(plan: Plan, cluster: Cluster, *, moto: MotoServer | None, sqs: Any) -> Outcome:
    """One interruption with its fault; returns what the checks found."""
    run = Run.prepare(plan, cluster)
    started = time.monotonic()
    imds = FakeImds(instance_id=instance_of(plan))
    imds.schedule_spot("terminate", run.deadline)
    queue_url = None
    if plan.queue:
        queue_url = await _queue_with_warning(sqs, plan, run.deadline)
    async with serving(imds) as imds_url:
        agent = Agent(agent_argv(run, imds_url=imds_url, queue_url=queue_url, moto=moto))
        inject(plan, cluster.kube, imds, agent)
        agent.start()
        problems = await _watch(run, agent, deleted=lambda: _deletes(moto, queue_url))
        cluster.kube.faults.clear()
        code = await agent.close()
    if code != 0:
        problems.append(f"the agent ended with {code}")
    lost = not run.done()
    if queue_url is not None:
        problems += _check_deletes(run, _deletes(moto, queue_url))
    intruded = run.intruded()
    struck = bool(cluster.kube.faults.struck) or plan.fault in IMDS_FAULTS
    cluster.kube.faults.struck.clear()
    return Outcome(plan, struck, problems + intruded, lost, bool(intruded), time.monotonic() - started)


async def _watch(run: Run, agent: Agent, *, deleted: Callable[[], list[Any]]) -> list[str]:
    """Wait until the run is done (in queue mode, its message deleted too) or its deadline; what went wrong."""
    while (run.deadline - utcnow()).total_seconds() > 0:
        if agent.exited():
            return ["the agent exited"]
        if run.done() and (not run.plan.queue or deleted()):
            await asyncio.sleep(0.1)  # a second delete, or a late touch elsewhere, would show now
            return []
        await asyncio.sleep(0.02)
    return ["not done by the deadline"]


def _deletes(moto: MotoServer | None, queue_url: str | None) -> list[Any]:
    if moto is None or queue_url is None:
        return []
    return moto.calls("DeleteMessage", QueueUrl=queue_url)


def _check_deletes(run: Run, deletes: list[Any]) -> list[str]:
    if len(deletes) != 1:
        return [f"the message was deleted {len(deletes)} times"]
    gone = [run.cluster.removed_at.get(f"ml/{pod}") for pod in run.pods]
    if None in gone or deletes[0].at < max(t for t in gone if t is not None):
        return ["the message was deleted before every pod had gone"]
    return []


async def _queue_with_warning(sqs: Any, plan: Plan, deadline: datetime) -> str:
    def create() -> str:
        url: str = sqs.create_queue(QueueName=f"campaign-{plan.number}-{random.getrandbits(32):08x}")["QueueUrl"]
        # The warning's deadline is its time plus two minutes: date it so the deadline is the run's.
        body = spot_warning(instance_of(plan), time=deadline - timedelta(seconds=120), region=REGION)
        sqs.send_message(QueueUrl=url, MessageBody=body)
        return url

    return await asyncio.to_thread(create)


async def campaign(
    *, runs: int, seed: int, workers: int, workdir: Path, moto: MotoServer | None = None, sqs: Any = None
) -> Tally:
    """``runs`` interruptions, ``workers`` at a time, each worker with a fake cluster of its own; a fifth of the runs
    in queue mode when ``moto`` (and an SQS client ``sqs`` for it) are given."""
    rng = random.Random(seed)
    plans = [Plan.draw(n, rng, queue=moto is not None and n % 5 == 4) for n in range(runs)]
    tally, started = Tally(), time.monotonic()

    async def worker(index: int) -> None:
        async with FakeKube() as kube:
            cluster = Cluster(kube, kube.write_kubeconfig(workdir / f"kubeconfig-{index}"))
            for plan in plans[index::workers]:
                tally.add(await run_once(plan, cluster, moto=moto, sqs=sqs))

    await asyncio.gather(*(worker(i) for i in range(workers)))
    tally.seconds = time.monotonic() - started
    return tally
