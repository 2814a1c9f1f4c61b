"""Settings of the NVMe model cache: the ``--model-cache-*`` flags, and the ``spotdrain cache`` subcommand's own.

``add_cache_arguments`` adds only the ``--model-cache-*`` flags (the node agent takes them beside its own);
``add_arguments`` is the whole ``spotdrain cache`` command line, which also names the node and the kubeconfig, and
has the ``fetch`` subcommand (agent.cache.fetch).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from spotdrain.settings import add_flag, add_kubeconfig_flag, add_switch, require

FILESYSTEMS = ("xfs", "ext4")
# md names live in the superblock beside the host name, in 32 bytes; keep them short and plain.
_MD_NAME = re.compile(r"[A-Za-z0-9_-]{1,24}")


@dataclass(frozen=True)
class CacheSettings:
    enabled: bool
    devices: str | None  # a glob or a comma list that replaces discovery; None: discover instance-store disks
    fs: str
    path: Path
    force: bool
    state_dir: Path
    name: str
    root: Path = Path("/")  # where /dev and /sys are looked for by discovery; tests point it at a fake tree
    wait_for_models: bool = False  # keep the startup taint while the node's models (spotdrain.io/models) are fetched

    @property
    def array_path(self) -> str:
        return f"/dev/md/{self.name}"

    @property
    def record_path(self) -> str:
        return str(self.state_dir / "mdadm.conf")


@dataclass(frozen=True)
class CacheCommandSettings:
    """What ``spotdrain cache`` needs beyond the cache: without a node name it only prepares the disks."""

    cache: CacheSettings
    node_name: str | None
    kubeconfig: str | None


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--model-cache-*`` flags, for ``spotdrain cache`` and ``spotdrain node`` alike."""
    add_switch(parser, "--model-cache", default=True, help="prepare the NVMe instance-store disks as a model cache")
    add_flag(
        parser,
        "--model-cache-devices",
        help="a glob or comma list of block devices to use instead of the discovered instance-store disks",
    )
    add_flag(parser, "--model-cache-fs", default="xfs", choices=FILESYSTEMS, help="filesystem of a new cache")
    add_flag(parser, "--model-cache-path", default="/mnt/model-cache", help="where the cache is mounted")
    add_switch(
        parser,
        "--model-cache-force",
        default=False,
        help="format devices that carry another filesystem (their data is lost)",
    )
    add_flag(
        parser,
        "--model-cache-state-dir",
        default="/var/lib/spotdrain",
        help="where the RAID0 array's configuration is recorded (mdadm.conf), on a disk that survives a stop",
    )
    add_flag(parser, "--model-cache-name", default="model-cache", help="name of the RAID0 array (/dev/md/NAME)")
    add_switch(
        parser,
        "--model-cache-wait-for-models",
        default=False,
        help="keep the startup taint on a node whose spotdrain.io/models annotation names models until `spotdrain "
        "cache prefetch` has them all (without it the taint goes once the cache is mounted)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``spotdrain cache`` command line: alone it prepares the cache; ``spotdrain cache fetch`` fills it."""
    from agent.cache import prefetch_settings
    from agent.cache.fetch import settings as fetch_settings

    add_cache_arguments(parser)
    commands = parser.add_subparsers(
        dest="cache_command",
        metavar="{fetch,prefetch}",
        help="fetch: fill the cache with a model; prefetch: with the models the node's spotdrain.io/models names, "
        "and stay to report them (without either: prepare the cache)",
    )
    fetch_settings.add_arguments(
        commands.add_parser("fetch", help="copy one model from S3 or a Hugging Face-style mirror into the cache")
    )
    prefetch_settings.add_arguments(
        commands.add_parser(
            "prefetch", help="fetch the models the node's spotdrain.io/models annotation names, labelling the node"
        )
    )
    add_flag(parser, "--node-name", aliases=("NODE_NAME",), help="label and untaint this node once the cache is ready")
    add_kubeconfig_flag(parser)


def from_arguments(args: argparse.Namespace) -> CacheSettings:
    """Build and validate the cache settings; raises SettingsError with the flag's name and the reason."""
    path = Path(args.model_cache_path)
    state_dir = Path(args.model_cache_state_dir)
    require(path.is_absolute() and path != Path("/"), "--model-cache-path must be an absolute path other than /")
    require(state_dir.is_absolute(), "--model-cache-state-dir must be an absolute path")
    require(
        _MD_NAME.fullmatch(args.model_cache_name) is not None,
        "--model-cache-name must be 1 to 24 letters, digits, '-' or '_'",
    )
    devices = args.model_cache_devices.strip() if args.model_cache_devices else None
    return CacheSettings(
        enabled=args.model_cache,
        devices=devices or None,
        fs=args.model_cache_fs,
        path=path,
        force=args.model_cache_force,
        state_dir=state_dir,
        name=args.model_cache_name,
        wait_for_models=args.model_cache_wait_for_models,
    )


def command_from_arguments(args: argparse.Namespace) -> CacheCommandSettings:
    return CacheCommandSettings(
        cache=from_arguments(args), node_name=args.node_name or None, kubeconfig=args.kubeconfig or None
    )
