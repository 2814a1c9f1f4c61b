"""``spotdrain inject -f FILE``: its flags, and the run that prints the manifest with the sidecar added.

``inject.manifest`` (and PyYAML with it) loads only when the command runs, so that every other command's parser
can be built without a YAML library.
"""

from __future__ import annotations

import argparse
import sys

from inject.pods import (
    ALWAYS_ALLOW,
    DEFAULT_IMAGE,
    DEFAULT_NOTICE_URL,
    ENGINE_PORTS,
    POLICY,
    WITHOUT_POLICY,
    InjectError,
    Options,
)
from spotdrain.settings import add_flag, add_switch, require, seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="manifest file (YAML, many documents), - for stdin")
    add_flag(parser, "--sidecar-image", default=DEFAULT_IMAGE, help="the sidecar's image")
    # No `choices`: SPOTDRAIN_ENGINE is also the sidecar's variable, and may hold a value only the sidecar takes
    # (custom); checked when inject runs, it cannot break the parser of every other command.
    add_flag(parser, "--engine", default="auto", help="auto (told by the image or command), vllm, tgi or sglang")
    add_flag(parser, "--container", help="the engine container's name (default: found by image or command)")
    add_flag(parser, "--drain-timeout", convert=seconds, default=110.0, help="the sidecar's --drain-timeout")
    add_flag(parser, "--notice-url", default=DEFAULT_NOTICE_URL, help="the sidecar's --notice-url ('' for none)")
    add_switch(
        parser,
        "--readiness-gate",
        default=False,
        help="add the spotdrain.io/serving readiness gate (the pod's account needs patch on pods/status)",
    )


def options_from(args: argparse.Namespace) -> Options:
    require(args.drain_timeout > 0, "--drain-timeout must be above 0 seconds")
    engines = ("auto", *ENGINE_PORTS)
    require(args.engine in engines, f"--engine {args.engine!r}: choose from {', '.join(engines)}")
    return Options(
        image=args.sidecar_image,
        engine=args.engine,
        container=args.container,
        drain_timeout_s=args.drain_timeout,
        notice_url=args.notice_url or None,
        readiness_gate=args.readiness_gate,
    )


def _read(filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    with open(filename, encoding="utf-8") as file:
        return file.read()


def main(args: argparse.Namespace) -> int:
    options = options_from(args)
    try:
        from inject import manifest
    except ImportError as error:
        print(f"spotdrain inject: error: needs PyYAML ({error}); pip install 'spotdrain[node]'", file=sys.stderr)
        return 2
    try:
        injected = manifest.inject_text(_read(args.filename), options)
    except (OSError, UnicodeDecodeError) as error:
        print(f"spotdrain inject: error: cannot read {args.filename}: {error}", file=sys.stderr)
        return 2
    except InjectError as error:
        print(f"spotdrain inject: error: {error}", file=sys.stderr)
        return 2
    if options.container is not None and options.container not in injected.containers:
        print(f"spotdrain inject: error: no workload has a container {options.container!r}", file=sys.stderr)
        return 2
    sys.stdout.write(injected.text)
    for where in injected.changed:
        print(f"spotdrain inject: added the sidecar to {where}", file=sys.stderr)
    for budget in (name for name, allows in injected.budgets.items() if not allows):
        print(f"spotdrain inject: warning: {budget} has no {POLICY}: {ALWAYS_ALLOW}; {WITHOUT_POLICY}", file=sys.stderr)
    if injected.changed and not injected.budgets:
        advice = f"a PodDisruptionBudget over these pods needs {POLICY}: {ALWAYS_ALLOW}; {WITHOUT_POLICY}"
        print(f"spotdrain inject: note: {advice}", file=sys.stderr)
    if not injected.changed:
        print("spotdrain inject: no engine without the sidecar found; the manifest is unchanged", file=sys.stderr)
    return 0
