"""The ``spotdrain cache fetch`` command line and its frozen settings."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cache.fetch.sources import Source, parse_source
from spotdrain.retry import BACKOFF_S
from spotdrain.settings import SettingsError, add_flag, add_switch, http_url, positive_int, require, seconds

# A directory name under <cache>/models: no separators, no dot first (.staging and .locks live beside the models).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MIB = 1024 * 1024


@dataclass(frozen=True)
class FetchSettings:
    source: Source
    name: str
    cache_path: Path
    aws_endpoint_url: str | None
    aws_region: str | None
    concurrency: int
    part_size_bytes: int
    wait: bool
    request_timeout_s: float  # no byte for this long ends a request (connect, or between reads)
    progress_interval_s: float  # log lines when stderr is not a terminal
    backoff_s: tuple[float, ...] = BACKOFF_S  # between attempts of one request
    wait_backoff_s: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)  # between whole fetches, with --wait

    @property
    def models(self) -> Path:
        return self.cache_path / "models"

    @property
    def target(self) -> Path:
        return self.models / self.name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="s3://bucket/prefix/ (every object under it) or hf+https://host/base/ORG/REPO[@REVISION]",
    )
    add_flag(parser, "--name", help="the model's directory: <cache>/models/NAME", default_help="required")
    add_transfer_arguments(parser)
    add_switch(
        parser,
        "--wait",
        default=False,
        help="for an init container: wait for another fetch of NAME and retry transient failures until complete",
    )
    add_flag(parser, "--progress-interval", convert=seconds, default=5.0, help="seconds between progress log lines")


def add_transfer_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the cache is and how models are downloaded into it: `cache fetch`'s flags that `cache prefetch` shares."""
    add_flag(parser, "--model-cache-path", default="/mnt/model-cache", help="where the cache is mounted")
    add_flag(parser, "--aws-endpoint-url", convert=http_url, help="S3 endpoint (S3-compatible servers, tests)")
    add_flag(
        parser,
        "--aws-region",
        aliases=("AWS_REGION", "AWS_DEFAULT_REGION"),
        help="region of the bucket",
        default_help="the profile's region, else us-east-1; the bucket's own region is followed",
    )
    add_flag(parser, "--concurrency", convert=positive_int, default=32, help="parts downloaded at once")
    add_flag(parser, "--part-size-mib", convert=positive_int, default=16, help="bytes per ranged request, in MiB")
    add_flag(parser, "--request-timeout", convert=seconds, default=30.0, help="seconds a request may go without a byte")


def from_arguments(args: argparse.Namespace) -> FetchSettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    try:
        source = parse_source(args.source)
    except ValueError as error:
        raise SettingsError(f"SOURCE: {error}") from None
    require(bool(args.name), "--name is required")
    require(_NAME.fullmatch(args.name) is not None, "--name must be letters, digits, '.', '-' or '_', not dot first")
    return FetchSettings(
        source=source,
        name=args.name,
        wait=args.wait,
        progress_interval_s=args.progress_interval or 5.0,
        **transfer_values(args),
    )


def transfer_values(args: argparse.Namespace) -> dict[str, Any]:
    """The validated values of ``add_transfer_arguments``' flags, by the field names both commands' settings use."""
    path = Path(args.model_cache_path)
    require(path.is_absolute() and path != Path("/"), "--model-cache-path must be an absolute path other than /")
    require(args.request_timeout > 0, "--request-timeout must be more than 0")
    return {
        "cache_path": path,
        "aws_endpoint_url": args.aws_endpoint_url or None,
        "aws_region": args.aws_region or None,
        "concurrency": args.concurrency,
        "part_size_bytes": args.part_size_mib * MIB,
        "request_timeout_s": args.request_timeout,
    }


__all__ = ["FetchSettings", "SettingsError", "add_arguments", "from_arguments"]
