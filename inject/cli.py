"""``spotdrain inject -f FILE``: its flags, and the run that prints the manifest with the sidecar added.

``inject.manifest`` (and PyYAML with it) loads only when the command runs, so that every other command's parser
can be built without a YAML library.
"""

from __future__ import annotations

import argparse
import sys

from inject.options import add_options, options_from
from inject.pods import ALWAYS_ALLOW, POLICY, WITHOUT_POLICY, InjectError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="manifest file (YAML, many documents), - for stdin")
    add_options(parser)


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
