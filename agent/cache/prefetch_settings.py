"""The ``spotdrain cache prefetch`` command line and its frozen settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from agent.cache.fetch.settings import add_transfer_arguments, transfer_values
from spotdrain.retry import BACKOFF_S
from spotdrain.settings import add_flag, add_kubeconfig_flag, add_switch, port, require, seconds


@dataclass(frozen=True)
class PrefetchSettings:
    node_name: str
    kubeconfig: str | None
    cache_path: Path
    aws_endpoint_url: str | None
    aws_region: str | None
    concurrency: int
    part_size_bytes: int
    request_timeout_s: float
    wait_for_models: bool  # remove the startup taint once every model is ready
    retry_failed_s: float  # a model whose fetch failed for good is tried again after this long
    host: str
    metrics_port: int
    once: bool = False  # exit once the models are ready (1 after a failure that retrying now will not mend)
    progress_interval_s: float = 5.0
    backoff_s: tuple[float, ...] = BACKOFF_S  # between attempts of one request
    transient_backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)  # between fetches failing on the source


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser, "--node-name", aliases=("NODE_NAME",), help="the node whose models to fetch", default_help="required"
    )
    add_kubeconfig_flag(parser)
    add_transfer_arguments(parser)
    add_switch(
        parser,
        "--model-cache-wait-for-models",
        default=False,
        help="remove the startup taint once every model is ready (`spotdrain cache` kept it with the same flag)",
    )
    add_flag(
        parser,
        "--retry-failed",
        convert=seconds,
        default=300.0,
        help="seconds before a model whose fetch failed for good (access denied, a 404, a bad checksum) is tried again",
    )
    add_switch(
        parser,
        "--once",
        default=False,
        help="exit 0 once every model is ready, 1 after a failure that retrying now will not mend, instead of serving "
        "the metrics until stopped (for a Job or a script)",
    )
    add_flag(parser, "--host", default="0.0.0.0", help="address of the metrics and probe server")
    add_flag(parser, "--metrics-port", convert=port, default=8091, help="port of /metrics, /livez and /readyz")


def from_arguments(args: argparse.Namespace) -> PrefetchSettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    require(bool(args.node_name), "--node-name (or NODE_NAME) is required")
    require(args.retry_failed > 0, "--retry-failed must be more than 0")
    return PrefetchSettings(
        node_name=args.node_name,
        kubeconfig=args.kubeconfig or None,
        **transfer_values(args),
        wait_for_models=args.model_cache_wait_for_models,
        retry_failed_s=args.retry_failed,
        host=args.host,
        metrics_port=args.metrics_port,
        once=args.once,
    )
