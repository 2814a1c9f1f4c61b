"""Which container of a pod runs an engine, and which engine: told by its image or the first words of its
command; on Ray, only a group that has GPUs runs one. Pure functions of plain dicts, as ``inject.pods``."""

from __future__ import annotations

from inject.spec import (
    ENGINE_PORTS,
    RAY_EXPORT_INTERVAL,
    RAY_LAG_INTERVALS,
    RAY_METRICS_PORT,
    SIDECAR,
    InjectError,
    Obj,
    Options,
    PodTarget,
    command_line,
    containers_of,
    list_of,
    section,
)

# Substrings of an image or of the start of a command line that tell the engine (Ray's LLM image runs vLLM).
ENGINE_MARKERS = (
    ("sglang", "sglang"),
    ("text-generation-inference", "tgi"),
    ("text-generation-launcher", "tgi"),
    ("vllm", "vllm"),
    ("ray-llm", "vllm"),
)
COMMAND_WORDS = 3  # `vllm serve`, `python -m vllm.entrypoints...`, `sh -c "vllm serve ..."`; later words are data
GPU = "nvidia.com/gpu"


def engine_port(container: Obj, engine: str) -> int:
    line = command_line(container)
    for i, part in enumerate(line):
        value = line[i + 1] if part == "--port" and i + 1 < len(line) else part.partition("=")[2]
        if (part == "--port" or part.startswith("--port=")) and value.isdigit():
            return int(value)
    where = f"container {container.get('name')!r}"
    ports = [p.get("containerPort") for p in list_of(container, "ports", where) if isinstance(p, dict)]
    return int(ports[0]) if ports and isinstance(ports[0], int) else ENGINE_PORTS[engine]


def engine_args(container: Obj, engine: str, ray_params: Obj | None) -> list[str]:
    if ray_params is None:
        return ["--engine", engine, "--engine-url", f"http://127.0.0.1:{engine_port(container, engine)}"]
    if engine != "vllm":
        raise InjectError(f"on Ray the sidecar reads Serve's count through Ray's metrics agent, not {engine}'s")
    port = str(ray_params.get("metrics-export-port", RAY_METRICS_PORT))
    if not port.isdigit():
        raise InjectError(f"rayStartParams metrics-export-port {port!r} is not a port")
    args = ["--engine", "ray", "--engine-url", f"http://127.0.0.1:{port}"]
    # The sidecar's own wait for a zero covers Ray's default export (10 s); a container that sets its own, each
    # second as docs/sidecar.md says, is waited for as long as its page can lag, and released that much sooner.
    interval_ms = _export_interval_ms(container)
    if interval_ms is not None:
        args += ["--zero-confirm", f"{RAY_LAG_INTERVALS * interval_ms / 1000:g}"]
    return args


def _export_interval_ms(container: Obj) -> int | None:
    where = f"container {container.get('name')!r}"
    for variable in list_of(container, "env", where):
        if isinstance(variable, dict) and variable.get("name") == RAY_EXPORT_INTERVAL:
            value = str(variable.get("value", ""))
            # Ray raises anything lower to 1000 (src/ray/stats/stats.h)
            return max(int(value), 1000) if value.isdigit() else None
    return None


def engine_of(container: Obj) -> str | None:
    """The engine a container runs, told by its image or command; None if it runs none we know.

    Only the first words of the command line count, URLs and flags aside: a client that calls a vLLM runs no
    engine, nor does a proxy told where one is (``spotdrain gateway --service=inference/vllm``).
    """
    words = [w for w in command_line(container)[:COMMAND_WORDS] if "://" not in w and not w.startswith("-")]
    text = " ".join([str(container.get("image", "")), *words]).lower()
    return next((engine for marker, engine in ENGINE_MARKERS if marker in text), None)


def has_sidecar(target: PodTarget) -> bool:
    for key in ("containers", "initContainers"):
        for container in containers_of(target.spec, key, target.where):
            if container.get("name") == SIDECAR or command_line(container)[:2] == ["spotdrain", "sidecar"]:
                return True
    return False


def _gpus(container: Obj, ray_params: Obj, where: str) -> float:
    resources = section(container, "resources", where)
    counts = [section(resources, part, where).get(GPU, 0) for part in ("limits", "requests")]
    counts.append(ray_params.get("num-gpus", 0))
    try:
        return max(float(count) for count in counts)
    except (TypeError, ValueError):
        raise InjectError(f"{where}: a GPU count is not a number") from None


def ray_gpus(target: PodTarget) -> bool:
    """A Ray pod's Ray container is its first; it runs an engine only where Ray has GPUs to give it."""
    containers = containers_of(target.spec, "containers", target.where)
    params = target.ray_params or {}
    return bool(containers) and _gpus(containers[0], params, target.where) > 0


def engine_container(target: PodTarget, options: Options) -> tuple[Obj, str] | None:
    """The container to put behind the sidecar and its engine; None when the pod runs no engine."""
    containers = containers_of(target.spec, "containers", target.where)
    if options.container is not None:
        named = [c for c in containers if c.get("name") == options.container]
        if not named:
            return None
        engine = options.engine if options.engine != "auto" else engine_of(named[0])
        if engine is None:
            raise InjectError(f"cannot tell the engine of container {options.container!r}; name it with --engine")
        return named[0], engine
    if target.ray_params is not None:
        containers = containers[:1] if ray_gpus(target) else []
    found = [(c, engine) for c in containers if (engine := engine_of(c)) is not None]
    if len(found) > 1:
        names = ", ".join(str(c.get("name")) for c, _ in found)
        raise InjectError(f"{target.where}: containers {names} all look like engines; choose one with --container")
    if not found:
        return None
    container, engine = found[0]
    return container, engine if options.engine == "auto" else options.engine


def no_engine(target: PodTarget, options: Options) -> str:
    """Why a pod without the sidecar did not get it: the containers it has (name and image) and the flag to use.
    Both front ends say it: ``spotdrain inject`` on standard error, the webhook as an AdmissionReview warning."""
    containers = containers_of(target.spec, "containers", target.where)
    seen = [f"{c.get('name')} ({c.get('image') or 'no image'})" for c in containers]
    among = f"among {', '.join(seen)}" if seen else "(the pod has no containers)"
    if options.container is not None:
        return f"no container named {options.container!r} (--container) {among}"
    if target.ray_params is not None and not ray_gpus(target):
        return "a Ray group without GPUs (num-gpus, nvidia.com/gpu) runs no engine"
    return f"no vLLM, TGI or SGLang container found {among}; name the engine's with --container NAME"
