"""The sidecar's settings: frozen, grouped, loaded once from flags and SPOTDRAIN_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from sidecar.engines import ENGINES, EngineSpec, custom_engine
from spotdrain.settings import SettingsError, add_flag, add_switch, http_url, port, require, seconds

SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True)
class EngineSettings:
    kind: str
    url: str
    in_flight_metric: str | None
    tokens_metric: str | None
    health_path: str

    @property
    def spec(self) -> EngineSpec:
        if self.kind == "custom":
            assert self.in_flight_metric is not None
            return custom_engine(self.in_flight_metric, tokens=self.tokens_metric, health_path=self.health_path)
        return ENGINES[self.kind]

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)


@dataclass(frozen=True)
class DrainSettings:
    dir: Path
    timeout_s: float
    endpoint_delay_s: float
    poll_interval_s: float
    stall_after_s: float
    zero_confirm_s: float
    notice_url: str | None
    notice_wait_s: float


@dataclass(frozen=True)
class GateSettings:
    enabled: bool
    pod_name: str | None
    pod_namespace: str | None
    serviceaccount_dir: Path


@dataclass(frozen=True)
class SidecarSettings:
    engine: EngineSettings
    drain: DrainSettings
    gate: GateSettings
    host: str
    port: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--engine", default="vllm", choices=(*ENGINES, "custom"), help="inference engine in the pod")
    add_flag(
        parser,
        "--engine-url",
        convert=http_url,
        default="http://127.0.0.1:8000",
        help="the engine's base URL",
    )
    add_flag(parser, "--engine-health-path", default=None, help="engine health path (default: the engine's own)")
    add_flag(parser, "--in-flight-metric", help="metric name(s), comma separated, summed as in-flight (custom)")
    add_flag(parser, "--tokens-metric", help="a counter that moves while tokens are generated (custom)")
    add_flag(parser, "--host", default="0.0.0.0", help="address for /ready, /live and /metrics")
    add_flag(parser, "--port", convert=port, default=8081, help="port for /ready, /live and /metrics")
    add_flag(
        parser,
        "--drain-dir",
        convert=Path,
        default=Path("/run/spotdrain"),
        help="directory shared with the engine",
    )
    add_flag(parser, "--drain-timeout", convert=seconds, default=110.0, help="seconds a drain may last")
    add_flag(
        parser,
        "--endpoint-delay",
        convert=seconds,
        default=5.0,
        help="seconds to wait for endpoints to update",
    )
    add_flag(parser, "--poll-interval", convert=seconds, default=0.5, help="seconds between engine readings")
    add_flag(parser, "--stall-after", convert=seconds, default=15.0, help="seconds of no progress that end a drain")
    add_flag(
        parser,
        "--zero-confirm",
        convert=seconds,
        help="seconds in-flight must read 0 before a drain ends (default: the engine's reporting lag)",
    )
    add_flag(parser, "--notice-url", convert=http_url, help="the node agent's notice endpoint")
    add_flag(
        parser,
        "--notice-wait",
        convert=seconds,
        default=30.0,
        help="seconds the notice endpoint may hold each request (a long poll; 0 polls every --poll-interval)",
    )
    add_switch(parser, "--readiness-gate", default=False, help="patch the pod condition spotdrain.io/serving")
    add_flag(parser, "--pod-name", aliases=("POD_NAME",), help="this pod's name (downward API)")
    add_flag(parser, "--pod-namespace", aliases=("POD_NAMESPACE",), help="this pod's namespace (downward API)")
    add_flag(
        parser,
        "--serviceaccount-dir",
        convert=Path,
        default=Path(SERVICEACCOUNT_DIR),
        help="service account token, CA and namespace",
    )


def _namespace(given: str | None, serviceaccount_dir: Path) -> str | None:
    if given:
        return given
    try:
        return (serviceaccount_dir / "namespace").read_text().strip() or None
    except OSError:
        return None


def from_arguments(args: argparse.Namespace) -> SidecarSettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    require(args.engine != "custom" or bool(args.in_flight_metric), "--engine custom needs --in-flight-metric")
    require(args.poll_interval > 0, "--poll-interval must be above 0 seconds")
    require(args.drain_timeout > 0, "--drain-timeout must be above 0 seconds")
    require(args.stall_after > 0, "--stall-after must be above 0 seconds")
    health_path = args.engine_health_path or (ENGINES[args.engine].health_path if args.engine in ENGINES else "/health")
    require(health_path.startswith("/"), f"--engine-health-path {health_path!r} must start with /")
    namespace = _namespace(args.pod_namespace, args.serviceaccount_dir)
    if args.readiness_gate:
        require(bool(args.pod_name), "--readiness-gate needs --pod-name (or POD_NAME from the downward API)")
        require(bool(namespace), "--readiness-gate needs --pod-namespace (or POD_NAMESPACE)")
    try:
        engine = EngineSettings(
            kind=args.engine,
            url=args.engine_url,
            in_flight_metric=args.in_flight_metric,
            tokens_metric=args.tokens_metric,
            health_path=health_path,
        )
        return SidecarSettings(
            engine=engine,
            drain=DrainSettings(
                dir=args.drain_dir,
                timeout_s=args.drain_timeout,
                endpoint_delay_s=args.endpoint_delay,
                poll_interval_s=args.poll_interval,
                stall_after_s=args.stall_after,
                zero_confirm_s=engine.spec.zero_confirm_s if args.zero_confirm is None else args.zero_confirm,
                notice_url=args.notice_url,
                notice_wait_s=args.notice_wait,
            ),
            gate=GateSettings(
                enabled=args.readiness_gate,
                pod_name=args.pod_name,
                pod_namespace=namespace,
                serviceaccount_dir=args.serviceaccount_dir,
            ),
            host=args.host,
            port=args.port,
        )
    except ValueError as error:
        raise SettingsError(str(error)) from None
