"""The ``spotdrain`` command: one subcommand per program; each reads flags and SPOTDRAIN_* variables."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from agent.logs import configure_logging
from agent.settings import SettingsError, add_flag


def _sidecar(parser: argparse.ArgumentParser) -> None:
    from sidecar.settings import add_arguments

    add_arguments(parser)


def _run_sidecar(args: argparse.Namespace) -> int:
    from sidecar.main import run
    from sidecar.settings import from_arguments

    return asyncio.run(run(from_arguments(args)))


def _node(parser: argparse.ArgumentParser) -> None:
    from daemonset.settings import add_arguments

    add_arguments(parser)


def _run_node(args: argparse.Namespace) -> int:
    from daemonset.main import run
    from daemonset.settings import from_arguments

    return asyncio.run(run(from_arguments(args)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotdrain", description="Keep LLM token streams alive when Spot GPU nodes are reclaimed."
    )
    add_flag(parser, "--log-format", default="auto", choices=("auto", "json", "console"), help="log output")
    add_flag(parser, "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sidecar = commands.add_parser(
        "sidecar", help="run beside an inference engine: own readiness, hold termination until streams end"
    )
    _sidecar(sidecar)
    sidecar.set_defaults(run=_run_sidecar)
    node = commands.add_parser(
        "node", help="the node agent: act on interruption notices from IMDS or SQS (taint, cordon, evict)"
    )
    _node(node)
    node.set_defaults(run=_run_node)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
        configure_logging(json=json_logs, level=args.log_level)
        code: int = args.run(args)
    except SettingsError as error:
        command = " ".join(a for a in (sys.argv[1:2] if argv is None else list(argv)[:1]))
        print(f"spotdrain {command}: error: {error}".replace("  ", " "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
