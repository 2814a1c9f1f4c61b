"""The simulated cluster on 127.0.0.1: the fake API with one GPU node, its pods' processes, the fake IMDS (or a queue)
and the real node agent. ``async with Cluster(...)`` starts nothing; ``start()`` brings it all up, and leaving the
block kills every process and stops every fake. A ``way`` other than spotdrain (``simulate.baselines``) runs no agent
and no sidecars: its pods are the engine alone, with that way's readiness probe and preStop hook.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Sequence
from contextlib import AsyncExitStack
from datetime import datetime, timedelta
from pathlib import Path
from types import TracebackType

from simulate.baselines import SEED_READINESS, SPOTDRAIN, Readiness, Way, adapted, shell
from simulate.chats import Chats
from simulate.fakes.imds import FakeImds, Served, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import engine_args, free_port, sidecar_args, wait_http
from simulate.kubelet import Kubelet, Pod
from simulate.nth import Target
from simulate.observe import agent_note, engine_cut, gateway_note, note_taker, sidecar_note
from simulate.probes import Probe, exec_probe, http_probe
from simulate.procs import Listener, Proc, ProcessGroup
from simulate.queue import Queue
from simulate.scenarios import Scenario
from simulate.settings import SimulationSettings
from simulate.timeline import Kind, Recorder
from spotdrain.clock import rfc3339, utcnow

NODE = "gpu-1"
NAMESPACE = "ml"
INSTANCE = "i-0123456789abcdef0"
LABELS = {"app": "vllm"}
STARTUP_S = 30.0
VLLM_STARTUP_S = 240.0  # real vLLM loads the tiny model in 30-70 s here, longer when several load at once


def startup_s(settings: SimulationSettings) -> float:
    """How long the cluster may take to start: its engines are the slow part."""
    return VLLM_STARTUP_S if settings.engine == "vllm" else STARTUP_S


class Cluster:
    def __init__(
        self,
        settings: SimulationSettings,
        scenario: Scenario,
        recorder: Recorder,
        *,
        workdir: Path,
        way: Way = SPOTDRAIN,
        ports: set[int] | None = None,
    ) -> None:
        self.settings = settings
        self.startup_s = startup_s(settings)
        self.way = way
        self.timings = settings.timings
        self.scenario = scenario
        self.recorder = recorder
        self.workdir = workdir
        self.procs = ProcessGroup(workdir)
        self.kube = FakeKube()
        self.kubelet = Kubelet(self.kube, recorder, namespace=NAMESPACE)
        self.imds = FakeImds(instance_id=INSTANCE)
        self.imds_url = ""
        self.queue: Queue | None = Queue(self.procs) if scenario.via_sqs else None
        self._ports: set[int] = set() if ports is None else ports  # shared by runs side by side
        self.spare_ports: dict[str, int] = {}
        self.notice_port = self.metrics_port = 0
        self.agent: Proc | None = None
        self._agent_starts = 0
        self._stack = AsyncExitStack()

    @property
    def pod_names(self) -> list[str]:
        return [f"vllm-{index}" for index in range(self.settings.pods)]

    @property
    def spare_names(self) -> list[str]:
        """With ``--gateway``, as many pods again on a second node that no notice reaches."""
        return [f"spare-{index}" for index in range(self.settings.pods)] if self.settings.gateway else []

    @property
    def notice_url(self) -> str:
        query = f"?node={NODE}" if self.queue is not None else ""  # a queue-mode agent speaks for every node
        return f"http://127.0.0.1:{self.notice_port}/v1/notice{query}"

    async def __aenter__(self) -> Cluster:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.kubelet.close()
        await self.procs.close()
        await self._stack.aclose()

    async def start(self) -> None:
        """Start the fakes, the agent and every pod; returns once all of them answer."""
        await self._stack.enter_async_context(self.kube)
        self.kube.on_delete(self.kubelet.on_delete)
        self.imds_url = await self.serve(self.imds)
        if self.queue is not None:
            await self.queue.start()
        self._seed_api()
        # Picked once the fakes listen on the ports the kernel gave them, so that none of these can be one of those.
        self.notice_port, self.metrics_port = self.port(), self.port()
        async with asyncio.timeout(self.startup_s):
            await asyncio.gather(
                *([self.start_agent()] if self.way.spotdrain else []),
                *(self._start_pod(name) for name in self.pod_names),
                *(self._start_spare(name) for name in self.spare_names),
            )

    def _seed_api(self) -> None:
        self.kube.add_node(NODE, provider_id=f"aws:///us-east-1a/{INSTANCE}", labels={"nvidia.com/gpu.present": "true"})
        for name in self.pod_names:
            self.kube.add_pod(
                NAMESPACE, name, node=NODE, labels=LABELS, owner_kind="ReplicaSet", grace_period_s=self.timings.grace_s
            )
        policy = "AlwaysAllow" if self.scenario.always_allow else None
        self.kube.add_pdb(
            NAMESPACE,
            "vllm",
            selector=LABELS,
            max_unavailable=self.scenario.max_unavailable,
            unhealthy_pod_eviction_policy=policy,
        )

    async def serve(self, fake: Served) -> str:
        """Serve ``fake`` on 127.0.0.1 until the cluster stops; returns its base URL."""
        return await self._stack.enter_async_context(serving(fake))

    def port(self) -> int:
        """A free port no other part of this run has been given (the kernel can hand out a free port twice)."""
        while (port := free_port()) in self._ports:
            pass
        self._ports.add(port)
        return port

    async def _start_pod(self, name: str) -> None:
        if not self.way.spotdrain:
            await self._start_bare_pod(name)
            return
        engine_port = self.port()
        drain_dir = self.workdir / name / "drain"
        engine, report = await self.start_engine(name, engine_port)
        sidecar, ready_url = await self.start_sidecar(
            name, engine_port, drain_dir=drain_dir, notice_url=self.notice_url
        )
        prestop = ("/bin/sh", str(drain_dir / "prestop"))
        pod = Pod(name, engine, sidecar, drain_dir, engine_port, readiness=http_probe(ready_url), prestop=prestop)
        pod.engine_report = report
        self.kubelet.adopt(pod)
        await wait_http(ready_url, status=200, timeout_s=STARTUP_S)

    async def start_sidecar(
        self, name: str, engine_port: int, *, drain_dir: Path, notice_url: str | None
    ) -> tuple[Proc, str]:
        """A pod's ``spotdrain sidecar``, asking ``notice_url`` (None: no node agent) for notices; returns it and its
        ``/ready`` URL."""
        port = self.port()
        sidecar = await self.procs.start(
            f"{name}-sidecar",
            sidecar_args(
                port=port, engine_port=engine_port, drain_dir=drain_dir, extra=self._sidecar_flags(notice_url)
            ),
            listener=note_taker(self.recorder, name, lambda fields: sidecar_note(fields, pod=name)),
        )
        return sidecar, f"http://127.0.0.1:{port}/ready"

    async def _start_bare_pod(self, name: str) -> None:
        """A pod of a way without spotdrain: the engine alone, with that way's probe and hook; ``tmp`` stands for
        the engine container's ``/tmp``."""
        port = self.port()
        tmp = self.workdir / name / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        engine, report = await self.start_engine(name, port)
        hook = self.way.prestop
        prestop = None if hook is None else shell(adapted(hook, tmp=tmp, engine_port=port, scale=self.timings.scale))
        pod = Pod(name, engine, None, tmp, port, readiness=self._probe(tmp, port), prestop=prestop)
        pod.engine_report = report
        self.kubelet.adopt(pod)
        await wait_http(f"http://127.0.0.1:{port}/health", status=200, timeout_s=STARTUP_S)

    async def start_engine(
        self, name: str, port: int, *, extra: Sequence[str] = (), listener: Listener | None = None
    ) -> tuple[Proc, dict[str, int]]:
        """A pod's fake vLLM (with ``extra`` flags, its log events also to ``listener``); returns it, once it
        listens, and where its own count of the streams it cut will be.

        Raises RuntimeError if it exits first: another process took its port between our pick and its bind (the
        machine may run other tests), or it could not read its model, and whatever answers there is not this pod's
        engine."""
        report: dict[str, int] = {}
        listening = asyncio.Event()

        def listen(fields: dict[str, object]) -> None:
            if fields.get("event") == "engine.listening":
                listening.set()
            if (cut := engine_cut(fields)) is not None:
                report["cut"] = cut
            if listener is not None:
                listener(fields)

        if self.settings.engine == "vllm":
            return await self._start_vllm(name, port), report
        args = engine_args(port, "--tokens-per-second", str(self.settings.tokens_per_s), *self.chat_flags(), *extra)
        ending = self.scenario.sigterm_ending(self.pod_names.index(name)) if name in self.pod_names else None
        if ending is not None:
            args += ["--sigterm-ending", ending]
        engine = await self.procs.start(f"{name}-engine", args, listener=listen)
        heard, exited = asyncio.ensure_future(listening.wait()), asyncio.ensure_future(engine.exited())
        try:
            await asyncio.wait([heard, exited], return_when=asyncio.FIRST_COMPLETED)
        finally:
            heard.cancel()
            exited.cancel()
        if not listening.is_set():
            raise RuntimeError(f"{name}'s engine exited before it listened on port {port}: see {engine.log_path}")
        return engine, report

    async def _start_vllm(self, name: str, port: int) -> Proc:
        """A pod's real vLLM (its API server and engine core, one process group); returns once it is healthy."""
        from simulate.venvs import python_of
        from simulate.vllm import server

        model = await asyncio.to_thread(server.tiny_model)
        python = str(python_of(server.venv_dir()))
        args = server.serve_args(model, port)
        engine = await self.procs.start(f"{name}-engine", args, env=server.ENGINE_ENV, python=python, group=True)
        await wait_http(f"http://127.0.0.1:{port}/health", status=200, timeout_s=self.startup_s)
        return engine

    def _probe(self, tmp: Path, port: int) -> Probe:
        if self.way.readiness is Readiness.SEED:
            return exec_probe(shell(adapted(SEED_READINESS, tmp=tmp, engine_port=port, scale=self.timings.scale)))
        return http_probe(f"http://127.0.0.1:{port}/health")

    def nth_target(self) -> Target:
        """Where the nth-style handler finds IMDS and the API, with a token that may do anything."""
        return Target(self.imds_url, self.kube.url, self.kube.token, self.kube.ca_path, NODE)

    async def _start_spare(self, name: str) -> None:
        """A pod on the second node: only its engine takes part, since nothing ever drains it."""
        port = self.port()
        await self.start_engine(name, port)
        self.spare_ports[name] = port

    def chats(self) -> Chats | None:
        """The scenario's chats, reasoning for longer than the notice; None: plain streams."""
        return Chats.lasting(self.timings.notice_s, self.settings.tokens_per_s) if self.scenario.chats else None

    def chat_flags(self) -> tuple[str, ...]:
        """The engines' parsers, for a scenario of chats (the fake engine's flags are vLLM's)."""
        return chats.engine_flags() if (chats := self.chats()) is not None else ()

    async def start_gateway(self, backend_url: str) -> str:
        """``spotdrain gateway`` in front of ``backend_url`` (the router, standing for the Service); its URL."""
        port, metrics_port = self.port(), self.port()
        flags = {"--host": "127.0.0.1", "--port": port, "--metrics-port": metrics_port, "--backend": backend_url}
        flags |= {"--health-interval": 0.2}
        args = [text for flag, value in flags.items() for text in (flag, str(value))]
        if self.scenario.chats:  # the backends' parsers, as deploy/gateway names them
            args += Chats.gateway_flags()
        listener = note_taker(self.recorder, "gateway", gateway_note)
        await self.procs.start(
            "gateway", ["-m", "spotdrain.cli", "--log-format", "json", "gateway", *args], listener=listener
        )
        await wait_http(f"http://127.0.0.1:{port}/health", status=200, timeout_s=STARTUP_S)
        return f"http://127.0.0.1:{port}"

    def _sidecar_flags(self, notice_url: str | None) -> list[str]:
        t = self.timings
        flags: dict[str, object] = {
            "--drain-timeout": t.window_s,
            "--endpoint-delay": t.endpoint_delay_s,
            "--poll-interval": t.poll_s,
        }
        if notice_url is not None:
            flags["--notice-url"] = notice_url
        return [text for flag, value in flags.items() for text in (flag, str(value))]

    def agent_args(self) -> list[str]:
        t = self.timings
        flags: dict[str, object] = {
            "--kubeconfig": self._kubeconfig(),
            "--host": "127.0.0.1",
            "--notice-port": self.notice_port,
            "--metrics-port": self.metrics_port,
            "--eviction-delay": t.eviction_delay_s,
            "--eviction-margin": t.eviction_margin_s,
        }
        if self.queue is not None:
            flags |= {**self.queue.agent_flags(), "--sqs-wait-time": 1}
        else:
            flags |= {"--node-name": NODE, "--imds-url": self.imds_url, "--imds-interval": t.imds_interval_s}
        args = [text for flag, value in flags.items() for text in (flag, str(value))]
        return ["-m", "spotdrain.cli", "--log-format", "json", "node", *args, "--no-model-cache"]

    def _kubeconfig(self) -> Path:
        path = self.workdir / "kubeconfig"
        if not path.exists():
            self.kube.write_kubeconfig(path, namespace=NAMESPACE)
        return path

    async def start_agent(self) -> None:
        """Start ``spotdrain node`` (again, after a kill); returns once it reports ready."""
        self._agent_starts += 1
        name = "node-agent" if self._agent_starts == 1 else f"node-agent-{self._agent_starts}"
        env = self.queue.credentials if self.queue is not None else None
        listener = note_taker(self.recorder, "node agent", agent_note)
        self.agent = await self.procs.start(name, self.agent_args(), listener=listener, env=env)
        await wait_http(f"http://127.0.0.1:{self.metrics_port}/readyz", status=200, timeout_s=STARTUP_S)

    async def kill_agent(self) -> None:
        """SIGKILL the node agent, as when its node runs out of memory; returns once it is gone."""
        if self.agent is None:
            return
        self.agent.signal(signal.SIGKILL)
        await self.agent.exited()
        text = "killed with SIGKILL mid-drain (notice published, pods not yet evicted); starting it again"
        self.recorder.record(Kind.AGENT_KILLED, "node agent", text)

    async def lose_node(self) -> datetime:
        """The node vanishes with no notice: its agent and every pod's processes are killed at once; returns when."""
        lost = utcnow()
        self.recorder.record(Kind.DEADLINE, f"node {NODE}", "the node is lost with no notice: every process on it dies")
        if self.agent is not None:
            self.agent.signal(signal.SIGKILL)
        await self.kubelet.reclaim()
        return lost

    async def deliver_notice(self) -> datetime:
        """Schedule the Spot interruption at IMDS or send it through the queue; returns its deadline."""
        deadline = _whole_second(utcnow() + timedelta(seconds=self.timings.notice_s))
        if self.queue is not None:
            await self.queue.send_spot_warning(instance=INSTANCE, deadline=deadline)
            how = "EventBridge Spot warning sent to the SQS queue"
        else:
            self.imds.schedule_spot("terminate", deadline)
            how = "IMDS spot/instance-action now answers terminate"
        left_s = (deadline - utcnow()).total_seconds()
        text = f"{how}: deadline {rfc3339(deadline)}, {left_s:.1f} s away"
        self.recorder.record(Kind.NOTICE, "sqs" if self.queue is not None else "imds", text)
        return deadline

    def node_patches(self) -> int:
        return self.kube.count("PATCH", "/api/v1/nodes/{name}")


def _whole_second(moment: datetime) -> datetime:
    # Notices carry whole seconds, as IMDS and EventBridge write them.
    return moment.replace(microsecond=0) + timedelta(seconds=math.ceil(moment.microsecond / 1e6))
