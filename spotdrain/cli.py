"""The ``spotdrain`` command: one subcommand per program; each reads flags and SPOTDRAIN_* variables."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from spotdrain.logs import configure_logging
from spotdrain.settings import SettingsError, add_flag

# name: (help, module with add_arguments(parser), module with main(args) -> int). Modules load only when needed,
# so the sidecar never imports what the node agent needs; an image that does not carry a program has no command
# for it (the sidecar image has no agent/, the agent image no sidecar/).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "sidecar": (
        "run beside an inference engine: own readiness, hold termination until streams end",
        "sidecar.settings",
        "sidecar.main",
    ),
    "node": (
        "the node agent: act on interruption notices from IMDS or SQS (taint, cordon, evict)",
        "agent.node_settings",
        "agent.main",
    ),
    "gateway": (
        "an OpenAI-compatible proxy that continues a broken stream on another replica",
        "gateway.settings",
        "gateway.main",
    ),
    "cache": ("prepare the NVMe model cache once and exit", "agent.cache.settings", "agent.cache.main"),
    "inject": (
        "print a manifest with the sidecar, probes, preStop, volume and grace period added",
        "inject.cli",
        "inject.cli",
    ),
    "webhook": (
        "a mutating admission webhook: give Pods labelled spotdrain.io/inject=true the sidecar at creation",
        "webhook.settings",
        "webhook.server",
    ),
    "check": (
        "what is wrong with a spotdrain install, read from the cluster (read-only)",
        "check.settings",
        "check.main",
    ),
    "simulate": (
        "a whole interruption on embedded fakes, printed as a timeline with a verdict",
        "simulate.cli",
        "simulate.cli",
    ),
}


# The extras each command's dependencies come from (pyproject.toml); the sidecar and the gateway run on the base
# install (the gateway uses uvloop and orjson where they are installed). A command run without its extra says so in
# one line instead of a traceback.
EXTRAS: dict[str, tuple[str, ...]] = {
    "node": ("node",),
    "cache": ("node",),
    "inject": ("inject",),
    "webhook": ("webhook",),
    "check": ("node",),
    "simulate": ("node", "webhook"),
}
# The project's own top-level packages: one of them missing is a program the image does not carry, not an extra.
_OWN = frozenset({"spotdrain"} | {module.partition(".")[0] for _, *modules in COMMANDS.values() for module in modules})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotdrain", description="Keep LLM token streams alive when Spot GPU nodes are reclaimed."
    )
    add_flag(parser, "--log-format", default="auto", choices=("auto", "json", "console"), help="log output")
    add_flag(parser, "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, arguments, _) in COMMANDS.items():
        module = _installed(arguments)
        if module is not None:
            module.add_arguments(commands.add_parser(name, help=help_text))
    return parser


def _installed(name: str) -> ModuleType | None:
    """The module, or None when its program is not installed here; any other failed import is raised."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and f"{name}.".startswith(f"{error.name}."):
            return None
        raise


def _command_in(argv: Sequence[str]) -> str:
    """The subcommand the words name: the first that is one (the options before it take only their choices)."""
    words = list(argv)
    name = next((word for word in words if word in COMMANDS), "")
    after = words[words.index(name) + 1 :] if name else []
    if name == "cache" and ("fetch" in after or "prefetch" in after):
        return "cache " + next(word for word in after if word in ("fetch", "prefetch"))
    return name


def _prog(words: Sequence[str]) -> str:
    return " ".join(("spotdrain", _command_in(words))).strip()


def _needs(command: str, error: ModuleNotFoundError) -> str:
    extras = EXTRAS.get(command.partition(" ")[0], ())
    if not extras:
        return f"{error} (reinstall spotdrain: one of its dependencies is missing)"
    named = " and ".join(f"the {extra!r} extra" for extra in extras)
    return f"needs {named} ({error}): pip install 'spotdrain[{','.join(extras)}]'"


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        parser = build_parser()
        args = parser.parse_args(words)
        json_logs = {"auto": None, "json": True, "console": False}[args.log_format]
        configure_logging(json=json_logs, level=args.log_level)
        code: int = importlib.import_module(COMMANDS[args.command][2]).main(args)
    except SettingsError as error:
        print(f"{_prog(words)}: error: {error}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as error:
        if error.name is None or error.name.partition(".")[0] in _OWN:
            raise
        print(f"{_prog(words)}: error: {_needs(_command_in(words), error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
