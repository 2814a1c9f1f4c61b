"""What each program costs idle, as whole processes on this machine: the price a node or a pod pays for spotdrain.

- the node agent in IMDS mode as the DaemonSet runs it (``--no-model-cache``), against the fake IMDS and API server;
- the node agent in queue mode, long-polling moto's SQS (a process of its own) at the default 20 s wait;
- one sidecar beside a fake vLLM engine, holding its long poll on the IMDS agent's notice endpoint, as deploy/vllm
  runs it;
- the gateway as deploy/gateway runs it (``--service``): watching the Service's EndpointSlices and the engine's node
  on the fake API server, the fake engine its one ready endpoint;
- the webhook, serving TLS, asked nothing but its health.

All run at once and are measured over one window: CPU as cores (user and system seconds over the window's length),
then resident memory (RSS) and the proportional set size (PSS, which splits a page shared by several processes among
them: here the interpreter's pages are shared by every process, in a cluster only by a pod's own). Meanwhile each
program gets what a cluster sends an idle one: its readiness probe every 5 s, its liveness probe every 10 s (the
manifests' ``periodSeconds``) and a scrape of ``/metrics`` every 15 s (the PodMonitors' ``interval``; the webhook
serves no metrics). Targets: the container's requests in the shipped manifests, which the scheduler reserves.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from bench.burst import CREDENTIALS, moto_process, sqs_client
from bench.common import Result, cpu_s, pss_mb, report, rss_mb
from bench.node import agent_args
from simulate.fakes.aws import REGION
from simulate.fakes.imds import FakeImds, serving
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import engine_args, free_port, sidecar_args, start, stop
from simulate.fakes.tls import TlsFiles, write_tls_files

WINDOW_S = 60.0
READINESS_S, LIVENESS_S, SCRAPE_S = 5.0, 10.0, 15.0
Process = asyncio.subprocess.Process


@dataclass(frozen=True)
class Probe:
    url: str
    period_s: float
    keep_alive: bool = False


@dataclass(frozen=True)
class Program:
    name: str
    process: Process
    probes: tuple[Probe, ...]
    cpu_request: float  # cores, the shipped container's request
    memory_request_mib: float
    how: str


def probes(base: str, *, ready: str, live: str, metrics: bool = True) -> tuple[Probe, ...]:
    # The kubelet probes on a new connection each time (pkg/probe/http/http.go: DisableKeepAlives: true), a TLS
    # handshake included; Prometheus keeps its scrape connection open.
    scrape = (Probe(f"{base}/metrics", SCRAPE_S, keep_alive=True),) if metrics else ()
    return (Probe(base + ready, READINESS_S), Probe(base + live, LIVENESS_S), *scrape)


def cli(*args: str) -> list[str]:
    return ["-m", "spotdrain.cli", "--log-format", "json", "--log-level", "warning", *args]


async def programs(workdir: Path, stack: AsyncExitStack, tls: TlsFiles) -> list[Program]:
    """Start the five programs (and the fakes they talk to); every process is stopped when ``stack`` closes."""

    async def started(args: Sequence[str], log: str, env: dict[str, str] | None = None) -> Process:
        process = await start(args, log_path=workdir / f"{log}.log", env=env)
        stack.push_async_callback(stop, process)
        return process

    kube = await stack.enter_async_context(FakeKube())
    kube.add_node("gpu-0")
    kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig")
    imds_url = await stack.enter_async_context(serving(FakeImds()))
    moto, sqs_endpoint = await moto_process()
    stack.push_async_callback(stop, moto)
    queue = sqs_client(sqs_endpoint).create_queue(QueueName="footprint")["QueueUrl"]

    imds_args = agent_args(node="gpu-0", imds_url=imds_url, kubeconfig=kubeconfig, extra=["--no-model-cache"])
    imds_metrics, notice_port = (imds_args[imds_args.index(flag) + 1] for flag in ("--metrics-port", "--notice-port"))
    queue_metrics = str(free_port())
    queue_args = ["node", "--queue-url", queue, "--aws-region", REGION, "--aws-endpoint-url", sqs_endpoint]
    queue_args += ["--kubeconfig", str(kubeconfig), "--host", "127.0.0.1", "--metrics-port", queue_metrics]
    queue_args += ["--notice-port", str(free_port())]
    engine_port, sidecar_port, gateway_metrics, webhook_port = (free_port() for _ in range(4))
    await started(engine_args(engine_port), "engine")
    notice_url = f"http://127.0.0.1:{notice_port}/v1/notice"
    sidecar = sidecar_args(
        port=sidecar_port, engine_port=engine_port, drain_dir=workdir / "drain", extra=["--notice-url", notice_url]
    )
    kube.set_endpoints("inference", "vllm", [("127.0.0.1", engine_port, True)], nodes=["gpu-0"])
    gateway = ["gateway", "--host", "127.0.0.1", "--port", str(free_port()), "--metrics-port", str(gateway_metrics)]
    gateway += ["--service", "inference/vllm", "--serviceaccount-dir", str(kube.serviceaccount_dir(workdir / "sa"))]
    webhook = ["webhook", "--host", "127.0.0.1", "--port", str(webhook_port)]
    webhook += ["--tls-cert", str(tls.cert_path), "--tls-key", str(tls.key_path)]

    local = "http://127.0.0.1:"
    return [
        Program(
            "agent_imds",
            await started(imds_args, "agent-imds"),
            probes(local + imds_metrics, ready="/readyz", live="/livez"),
            0.020,
            96,
            "spotdrain node, IMDS mode at the 1 s interval, --no-model-cache (daemonset/base)",
        ),
        Program(
            "agent_queue",
            await started(cli(*queue_args), "agent-queue", env=CREDENTIALS),
            probes(local + queue_metrics, ready="/readyz", live="/livez"),
            0.020,
            128,
            "spotdrain node, queue mode, an empty queue long-polled every 20 s (daemonset/queue)",
        ),
        Program(
            "sidecar",
            await started(sidecar, "sidecar"),
            probes(f"{local}{sidecar_port}", ready="/ready", live="/live"),
            0.010,
            48,
            "spotdrain sidecar at default settings, long-polling the IMDS agent's notice endpoint (deploy/vllm)",
        ),
        Program(
            "gateway",
            await started(cli(*gateway), "gateway", env=kube.service_env()),
            probes(f"{local}{gateway_metrics}", ready="/ready", live="/live"),
            0.500,
            128,
            "spotdrain gateway --service, one ready endpoint, watching it and its node (deploy/gateway)",
        ),
        Program(
            "webhook",
            await started(cli(*webhook), "webhook"),
            probes(f"https://127.0.0.1:{webhook_port}", ready="/healthz", live="/healthz", metrics=False),
            0.020,
            64,
            "spotdrain webhook, TLS, no admission request (deploy/webhook)",
        ),
    ]


async def probing(probe: Probe, context: ssl.SSLContext, failures: list[str]) -> None:
    """GET the probe's URL every period as the kubelet or Prometheus would, noting every answer that is not a 200;
    runs until cancelled."""
    connector = aiohttp.TCPConnector(force_close=not probe.keep_alive, ssl=context)
    async with aiohttp.ClientSession(connector=connector) as session:
        while True:
            try:
                async with session.get(probe.url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    await response.read()
                    if response.status != 200:
                        failures.append(f"{probe.url}: {response.status}")
            except (TimeoutError, aiohttp.ClientError) as error:
                failures.append(f"{probe.url}: {error!r}")
            await asyncio.sleep(probe.period_s)


@asynccontextmanager
async def probed(every: Sequence[Program], context: ssl.SSLContext) -> AsyncIterator[list[str]]:
    failures: list[str] = []
    tasks = [asyncio.create_task(probing(probe, context, failures)) for p in every for probe in p.probes]
    try:
        yield failures
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def results(program: Program, cores: float, *, window_s: float) -> list[Result]:
    pid = program.process.pid
    rss, pss = rss_mb(pid), pss_mb(pid)
    shown = "no PSS on this kernel" if pss is None else f"PSS {pss:.1f} MiB"
    name = f"footprint_{program.name}"
    tick = 1 / os.sysconf("SC_CLK_TCK") / window_s
    over = f"{program.how}; over {window_s:g} s (one clock tick: {tick:.5f} cores)"
    return [
        Result.below(f"{name}_cpu", cores, "cores", program.cpu_request, over),
        Result.below(f"{name}_rss", rss, "MiB", program.memory_request_mib, f"{shown}; {program.how}"),
    ]


async def measure(window_s: float = WINDOW_S) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="spotdrain-bench-footprint-") as directory:
        workdir = Path(directory)
        async with AsyncExitStack() as stack:
            tls = write_tls_files(workdir / "tls")
            every = await programs(workdir, stack, tls)
            context = ssl.create_default_context(cafile=str(tls.ca_path))
            for program in every:
                await answering(program.probes[0].url, context)
            async with probed(every, context) as failures:
                await asyncio.sleep(2.0)  # past the first answers and requests of start
                before, began = [cpu_s(p.process.pid) for p in every], time.monotonic()
                await asyncio.sleep(window_s)
                took = time.monotonic() - began
                cores = [(cpu_s(p.process.pid) - b) / took for p, b in zip(every, before, strict=True)]
            if failures:
                raise RuntimeError(f"an idle program did not answer its probes: {failures[:5]}")
            return [r for p, c in zip(every, cores, strict=True) for r in results(p, c, window_s=window_s)]


async def answering(url: str, context: ssl.SSLContext, timeout_s: float = 60.0) -> None:
    """Return once ``url`` answers 200 (a program started and ready); TimeoutError after ``timeout_s``."""
    async with asyncio.timeout(timeout_s), aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url, ssl=context, timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.1)


if __name__ == "__main__":
    report(asyncio.run(measure()))
