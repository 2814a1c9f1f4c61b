"""The gateway's settings: frozen, grouped, loaded once from flags and SPOTDRAIN_* variables."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from gateway.cpus import default_workers
from spotdrain.settings import (
    SettingsError,
    add_flag,
    add_switch,
    env_name,
    http_url,
    port,
    positive_int,
    require,
    seconds,
)

MIB = 1 << 20
SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class MigrationSettings:
    limit: int  # continuations per request
    margin_s: float  # with --service: streams move this long before their node's termination time
    max_tokens: int  # beyond this many tokens sent, a broken stream is not continued
    mark_splices: bool  # an SSE comment line where a continuation starts


@dataclass(frozen=True)
class ParserSettings:
    """The parsers the backends split chats with, as their ``--reasoning-parser`` and ``--tool-call-parser`` say
    (None: not served with one). The gateway continues a parsed chat only where it can replay the parser."""

    reasoning: str | None
    tools: str | None


NO_PARSERS = ParserSettings(None, None)


@dataclass(frozen=True)
class TimeoutSettings:
    connect_s: float
    read_s: float  # longest silence from a backend, or a client not reading, before it counts as gone
    request_s: float  # a whole non-streamed request
    health_interval_s: float


# A watch silent this much longer than the timeoutSeconds it asked for is dead: the server would have ended it.
WATCH_GRACE_S = 5.0


@dataclass(frozen=True)
class ServiceSettings:
    namespace: str
    name: str
    port: str | None  # a port name or number of the slices; None: the first
    serviceaccount_dir: Path
    watch_timeout_s: float  # each watch asks the API server to end it after this (timeoutSeconds), then resumes

    @property
    def watch_silence_s(self) -> float:
        """No byte from a watch for this long: it is restarted from its last resourceVersion."""
        return self.watch_timeout_s + WATCH_GRACE_S


@dataclass(frozen=True)
class GatewaySettings:
    backends: tuple[str, ...]
    service: ServiceSettings | None  # backends from this Service's EndpointSlices instead
    ready_urls: tuple[str, ...]  # one per backend, or none: then each backend's own /health
    migration: MigrationSettings
    parsers: ParserSettings
    timeouts: TimeoutSettings
    host: str
    port: int
    metrics_port: int
    max_body_bytes: int
    workers: int  # processes sharing the API port
    spill_at: float  # a worker's share of a CPU past which the next takes connections too


def _share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not between 0 and 1")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def _urls_from_env(flag: str) -> list[str] | None:
    raw = os.environ.get(env_name(flag))
    if raw is None:
        return None
    try:
        return [http_url(url.strip()) for url in raw.split(",") if url.strip()]
    except argparse.ArgumentTypeError as error:
        raise SettingsError(f"{env_name(flag)}={raw!r}: {error}") from None


def _add_url_list(parser: argparse.ArgumentParser, flag: str, *, help: str) -> None:
    """A repeatable URL flag; ``SPOTDRAIN_<FLAG>`` holds the list, comma separated."""
    parser.add_argument(
        flag, action="append", type=http_url, default=None, help=f"{help} (env {env_name(flag)}, comma separated)"
    )
    parser.set_defaults(**{flag.lstrip("-").replace("-", "_") + "_env": _urls_from_env(flag)})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_url_list(parser, "--backend", help="an engine's base URL, repeatable")
    _add_url_list(
        parser,
        "--ready-url",
        help="a URL whose 200 puts the backend of the same position in rotation, e.g. its sidecar's /ready",
    )
    add_flag(parser, "--service", help="NAMESPACE/NAME: backends are this Service's ready endpoints")
    add_flag(parser, "--service-port", help="the EndpointSlice port (name or number) to use; default: the first")
    add_flag(
        parser,
        "--serviceaccount-dir",
        convert=Path,
        default=Path(SERVICEACCOUNT_DIR),
        help="service account token and CA, to watch EndpointSlices and nodes",
    )
    add_flag(
        parser,
        "--watch-timeout",
        convert=seconds,
        default=30.0,
        help="with --service: seconds each watch asks the API server to run (timeoutSeconds) before it resumes",
    )
    add_flag(
        parser,
        "--reasoning-parser",
        help="the backends' own --reasoning-parser (deepseek_r1 and qwen3 streams continue; others are cut)",
    )
    add_flag(
        parser,
        "--tool-call-parser",
        help="the backends' own --tool-call-parser, with --enable-auto-tool-choice (hermes continues; others are cut)",
    )
    add_flag(parser, "--host", default="0.0.0.0", help="address for the API and /metrics")
    add_flag(parser, "--port", convert=port, default=8000, help="port of the OpenAI-compatible API")
    add_flag(parser, "--metrics-port", convert=port, default=9090, help="port for /metrics, /live and /ready")
    add_flag(parser, "--migration-limit", convert=_non_negative_int, default=3, help="continuations per request")
    add_flag(
        parser,
        "--migration-max-tokens",
        convert=positive_int,
        default=16384,
        help="a stream that has sent more tokens than this is not continued",
    )
    add_switch(parser, "--mark-splices", default=True, help="write an SSE comment line where a stream continues")
    add_flag(
        parser,
        "--migration-margin",
        convert=seconds,
        default=15.0,
        help="with --service: seconds before a node's spotdrain.io/termination-time that its streams move",
    )
    add_flag(
        parser,
        "--workers",
        convert=positive_int,
        help="gateway processes sharing the API port, each restarted if it dies",
        default_help="the CPUs the container may use, from its cgroup quota",
    )
    add_flag(
        parser,
        "--spill-at",
        convert=_share,
        default=0.5,
        help="with several workers: the share of a CPU a worker uses before the next takes new connections too "
        "(0: every worker takes them from the start)",
    )
    add_flag(parser, "--max-body-bytes", convert=positive_int, default=16 * MIB, help="larger request bodies get 413")
    add_flag(parser, "--connect-timeout", convert=seconds, default=5.0, help="seconds to connect to a backend")
    add_flag(
        parser,
        "--read-timeout",
        convert=seconds,
        default=60.0,
        help="seconds of silence from a backend (or of a client not reading) that end its stream",
    )
    add_flag(parser, "--request-timeout", convert=seconds, default=600.0, help="seconds for a whole non-streamed call")
    add_flag(parser, "--health-interval", convert=seconds, default=2.0, help="seconds between backend health checks")


def _service(args: argparse.Namespace) -> ServiceSettings | None:
    if not args.service:
        return None
    namespace, _, name = str(args.service).partition("/")
    require(bool(namespace) and bool(name) and "/" not in name, f"--service {args.service!r} is not NAMESPACE/NAME")
    require(args.watch_timeout >= 1, "--watch-timeout must be at least 1 second")
    return ServiceSettings(namespace, name, args.service_port, args.serviceaccount_dir, args.watch_timeout)


def from_arguments(args: argparse.Namespace) -> GatewaySettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    backends = tuple(args.backend or args.backend_env or ())
    service = _service(args)
    require(bool(backends) != (service is not None), "give either --backend (at least one) or --service, not both")
    require(len(set(backends)) == len(backends), "--backend lists the same URL twice")
    ready_urls = tuple(args.ready_url or args.ready_url_env or ())
    require(not (service and ready_urls), "--ready-url goes with --backend; a Service's endpoints carry readiness")
    require(
        len(ready_urls) in (0, len(backends)),
        f"give one --ready-url per --backend, in the same order ({len(ready_urls)} for {len(backends)})",
    )
    for flag, value in (
        ("--connect-timeout", args.connect_timeout),
        ("--read-timeout", args.read_timeout),
        ("--request-timeout", args.request_timeout),
        ("--health-interval", args.health_interval),
    ):
        require(value > 0, f"{flag} must be above 0 seconds")
    return GatewaySettings(
        backends=backends,
        service=service,
        ready_urls=ready_urls,
        migration=MigrationSettings(
            limit=args.migration_limit,
            margin_s=args.migration_margin,
            max_tokens=args.migration_max_tokens,
            mark_splices=args.mark_splices,
        ),
        parsers=ParserSettings(reasoning=args.reasoning_parser or None, tools=args.tool_call_parser or None),
        timeouts=TimeoutSettings(
            connect_s=args.connect_timeout,
            read_s=args.read_timeout,
            request_s=args.request_timeout,
            health_interval_s=args.health_interval,
        ),
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        max_body_bytes=args.max_body_bytes,
        workers=args.workers or default_workers(),
        spill_at=args.spill_at,
    )
