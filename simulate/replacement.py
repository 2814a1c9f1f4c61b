"""The node that takes the interrupted one's place in the ``cold-start`` scenario: it joins, its model cache is made
ready, its model is hydrated from S3, and an engine pod on it serves a first token.

What stands for what, with durations for a 120 s notice (compressed as the notice is: times N / 120):

- Karpenter launches a replacement on the notice; the new instance registers as node ``gpu-2`` 30 s later, with
  the startup taint ``spotdrain.io/model-cache-pending:NoSchedule`` and the annotation ``spotdrain.io/models:
  NAME=s3://bucket/prefix/`` its NodePool's template gives it.
- 3 s later its cache is mounted: the label ``spotdrain.io/model-cache=ready`` and the taint's removal are written
  to the fake API directly, as ``spotdrain cache --node-name`` patches a real node once it has formatted and mounted
  its NVMe disks (which the simulation has none of; its cache is a directory). The engine pod is scheduled then.
- The model is hydrated from ``simulate.fakes.s3``, serving a made-up checkpoint (``simulate.model``) at the rate
  that copies it in 20 s, as a 16 GB checkpoint at 800 MB/s would be.
- The engine (the fake, reading the checkpoint with ``--model-dir``) and its sidecar start once the hydration has
  returned 0, and a client's request gets its first token.

Hydration is one function, called from one place (``Replacement.run``): here the engine pod's init container
running ``spotdrain cache fetch --wait``. A node agent that fetches the models its node's annotation names would be
another ``Hydrate``, and the pod would wait on it instead.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import aiohttp

from simulate.cluster import LABELS, NAMESPACE, STARTUP_S, Cluster
from simulate.fakes.processes import wait_http
from simulate.fakes.s3 import REGION, FakeS3
from simulate.model import copy_problems, expected, read_copy, tiny_checkpoint
from simulate.observe import Fields, fetch_note, note_taker
from simulate.timeline import Kind

NODE = "gpu-2"
INSTANCE = "i-0fedcba9876543210"
POD = "vllm-new"
BUCKET, PREFIX, MODEL = "models", "llama-tiny/", "llama-tiny"
# agent.cache.plan's READY_LABEL and PENDING_TAINT, and the annotation a prefetching agent reads; simulate/ never
# imports the agent.
READY_LABEL = "spotdrain.io/model-cache"
PENDING_TAINT = "spotdrain.io/model-cache-pending"
MODELS_ANNOTATION = "spotdrain.io/models"
JOIN_S, CACHE_S, HYDRATE_S = 30.0, 3.0, 20.0  # for a 120 s notice
FIRST_TOKEN_TIMEOUT_S = 10.0

# (the node, the model's name, its source) -> the exit status of whatever hydrated it: 0 once it is whole.
Hydrate = Callable[["Replacement", str, str], Awaitable[int]]


def models_of(annotation: str) -> dict[str, str]:
    """``NAME=SOURCE[,NAME=SOURCE...]``: each model's source by name."""
    pairs = (item.strip().partition("=") for item in annotation.split(",") if item.strip())
    return {name.strip(): source.strip() for name, _, source in pairs if name.strip() and source.strip()}


async def fetch_in_init_container(node: Replacement, name: str, source: str) -> int:
    """The engine pod's init container: ``spotdrain cache fetch SOURCE --name NAME --wait`` into the node's cache,
    with S3 at the fake; returns its exit status once it has exited."""
    flags = {
        "--name": name,
        "--model-cache-path": node.cache,
        "--aws-endpoint-url": node.s3_url,
        "--aws-region": REGION,
        "--part-size-mib": 1,
        "--request-timeout": 5,
    }
    args = ["-m", "spotdrain.cli", "--log-format", "json", "cache", "fetch", source, "--wait"]
    args += [text for flag, value in flags.items() for text in (flag, str(value))]
    listener = note_taker(node.recorder, POD, lambda fields: fetch_note(fields, pod=POD))
    proc = await node.cluster.procs.start(f"{POD}-init", args, listener=listener, env=node.aws_env())
    return await proc.exited()


class Replacement:
    def __init__(self, cluster: Cluster, *, hydrate: Hydrate = fetch_in_init_container) -> None:
        self.cluster = cluster
        self.recorder = cluster.recorder
        self.scale = cluster.timings.scale
        self.files = tiny_checkpoint()
        self.s3 = FakeS3(bytes_per_s=sum(map(len, self.files.values())) / (HYDRATE_S * self.scale))
        for path, data in self.files.items():
            self.s3.put(BUCKET, PREFIX + path, data)
        self.s3_url = ""
        self.cache = cluster.workdir / NODE / "model-cache"
        self.hydrate = hydrate

    def aws_env(self) -> dict[str, str]:
        """Credentials of no account, and no config file or instance profile to find others in."""
        nowhere = str(self.cluster.workdir / "no-aws-config")
        return {
            "AWS_ACCESS_KEY_ID": "AKIASIMULATED",
            "AWS_SECRET_ACCESS_KEY": "simulated",
            "AWS_CONFIG_FILE": nowhere,
            "AWS_SHARED_CREDENTIALS_FILE": nowhere,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    async def start(self) -> None:
        """Serve the bucket; the node is not there yet."""
        self.s3_url = await self.cluster.serve(self.s3)

    async def run(self) -> None:
        """From the notice on: join, ready the cache, hydrate, start the pod, ask for a first token. Returns after
        the first token, or once a step has failed (recorded on the timeline: the verdict finds the rest missing)."""
        await asyncio.sleep(JOIN_S * self.scale)
        self._join()
        await asyncio.sleep(CACHE_S * self.scale)
        self._cache_ready()
        name, source = self._model()
        code = await self.hydrate(self, name, source)
        if code != 0:
            text = f"hydration exited {code}: the engine container does not start"
            self.recorder.record(Kind.FETCH_FAILED, POD, text, pod=POD, code=code)
            return
        self._model_ready(name)
        try:
            port = await self._start_pod(name)
        except RuntimeError as error:  # the engine exited before it listened: the verdict finds no pod ready
            self.recorder.record(Kind.FETCH_FAILED, POD, f"engine did not start: {error}", pod=POD, code=code)
            return
        await self._first_token(port)

    def _join(self) -> None:
        kube = self.cluster.kube
        kube.add_node(
            NODE,
            provider_id=f"aws:///us-east-1b/{INSTANCE}",
            labels={"nvidia.com/gpu.present": "true"},
            taints=[{"key": PENDING_TAINT, "effect": "NoSchedule"}],
        )
        source = f"s3://{BUCKET}/{PREFIX}"
        kube.annotate_node(NODE, {MODELS_ANNOTATION: f"{MODEL}={source}"})
        text = f"replacement joined, tainted {PENDING_TAINT}:NoSchedule, {MODELS_ANNOTATION}: {MODEL}={source}"
        self.recorder.record(Kind.NODE_JOINED, f"node {NODE}", text)

    def _cache_ready(self) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        self.cluster.kube.relabel_node(NODE, labels={READY_LABEL: "ready"}, without_taint=PENDING_TAINT)
        self.cluster.kube.add_pod(
            NAMESPACE,
            POD,
            node=NODE,
            labels=LABELS,
            owner_kind="ReplicaSet",
            ready=False,
            grace_period_s=self.cluster.timings.grace_s,
        )
        text = f"cache mounted: labelled {READY_LABEL}=ready, taint removed; {POD} scheduled, its init container starts"
        self.recorder.record(Kind.CACHE_READY, f"node {NODE}", text)

    def _model(self) -> tuple[str, str]:
        """The model the node's annotation names (the first, if several), and its source."""
        annotations = self.cluster.kube.node(NODE)["metadata"].get("annotations", {})
        return next(iter(models_of(annotations.get(MODELS_ANNOTATION, "")).items()))

    def _model_ready(self, name: str) -> None:
        found, manifest = read_copy(self.cache / "models" / name)
        problems = copy_problems(expected(self.files), found, manifest)
        size = sum(f.size for f in found.values())
        verdict = "identical to the source (sizes, MD5s, manifest)" if not problems else f"BUT {problems[0]}"
        text = f"model ready: {len(found)} files, {size / 2**20:.1f} MiB in models/{name}, {verdict}"
        self.recorder.record(
            Kind.MODEL_READY, POD, text, pod=POD, code=0, files=len(found), bytes=size, problems=problems
        )

    async def _start_pod(self, name: str) -> int:
        """The engine container, reading the model, and its sidecar (no node agent runs on this node: no notice
        URL); returns the engine's port once the sidecar's ``/ready`` answers 200."""

        def loaded(fields: Fields) -> None:
            if fields.get("event") == "engine.model_loaded":
                text = f"engine started: read {fields.get('files')} files of the model from the cache"
                self.recorder.record(Kind.ENGINE_STARTED, POD, text, pod=POD, files=fields.get("files"))

        port = self.cluster.port()
        model_dir = self.cache / "models" / name
        await self.cluster.start_engine(POD, port, extra=["--model-dir", str(model_dir)], listener=loaded)
        drain_dir = self.cluster.workdir / POD / "drain"
        _, ready_url = await self.cluster.start_sidecar(POD, port, drain_dir=drain_dir, notice_url=None)
        await wait_http(ready_url, status=200, timeout_s=STARTUP_S)
        self.cluster.kube.set_containers_ready(NAMESPACE, POD, True)
        self.recorder.record(Kind.POD_READY, POD, "engine pod ready: its sidecar's /ready answers 200", pod=POD)
        return port

    async def _first_token(self, port: int) -> None:
        """One client's streamed request to the new pod; records its first token and returns."""
        asked = self.recorder.now()
        body = {"prompt": "hello", "max_tokens": 4, "stream": True}
        timeout = aiohttp.ClientTimeout(total=FIRST_TOKEN_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response,
        ):
            async for raw in response.content:
                text = _token_text(raw)
                if text is not None:
                    took = self.recorder.now() - asked
                    said = f"first token served: {text!r}, {took:.2f} s after the client asked"
                    self.recorder.record(Kind.FIRST_TOKEN, POD, said, pod=POD)
                    return


def _token_text(raw: bytes) -> str | None:
    """The text of an SSE line's first choice; None for any other line."""
    line = raw.decode(errors="replace").strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    try:
        choices = json.loads(line.removeprefix("data: ")).get("choices") or []
    except (ValueError, AttributeError):
        return None
    text = choices[0].get("text") if choices and isinstance(choices[0], dict) else None
    return text if isinstance(text, str) and text else None
