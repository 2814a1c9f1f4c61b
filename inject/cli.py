"""``spotdrain inject -f FILE``: its flags, and the run that prints the manifest with the sidecar added.

``inject.manifest`` (and PyYAML with it) loads only when the command runs, so that every other command's parser
can be built without a YAML library.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from inject.options import add_options, options_from
from inject.spec import ALWAYS_ALLOW, POLICY, WITHOUT_POLICY, InjectError, Options
from spotdrain.settings import add_switch

if TYPE_CHECKING:
    from inject.manifest import Injected

PREFIX = "spotdrain inject:"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", required=True, help="manifest file (YAML, many documents), - for stdin")
    add_options(parser)
    add_switch(
        parser,
        "--strict",
        default=False,
        help="an object that lacks a required field (a Deployment without spec.selector) is an error, exit 2",
    )
    add_switch(
        parser,
        "--gate-rbac",
        default=True,
        help="with --readiness-gate, also print the Role and RoleBinding the gate needs (not the ServiceAccount)",
    )


def _read(filename: str) -> str:
    if filename == "-":
        return sys.stdin.read()
    with open(filename, encoding="utf-8") as file:
        return file.read()


def _say(kind: str, text: str) -> None:
    print(f"{PREFIX} {kind}: {text}" if kind else f"{PREFIX} {text}", file=sys.stderr)


Said = tuple[str, str]  # a kind ("warning", "note" or "") and what to say on standard error


def _gate_rbac(injected: Injected, options: Options, *, emit: bool) -> tuple[str, list[Said]]:
    """The gate's RBAC for the injected pods' accounts, as documents to append (none without ``emit``), and what to
    say of what each account still needs."""
    from inject import manifest, rbac

    if not options.readiness_gate:
        return "", []
    said: list[Said] = []
    pods = [pod for pod in injected.pods if pod.outcome.injected]
    for pod in pods:
        if pod.account == rbac.DEFAULT:
            said.append(("warning", rbac.default_account_advice(pod.where)))
        elif not emit:
            needs = "patch on pods/status (the readiness gate; --gate-rbac prints a Role and RoleBinding for it)"
            said.append(("warning", f"{pod.where}: its ServiceAccount {pod.account!r} must have {needs}"))
    if not emit:
        return "", said
    accounts = [(pod.namespace, pod.account) for pod in pods]
    objects = rbac.gate_objects(accounts, injected.present)
    said += [("", f"added {obj['kind']} {obj['metadata']['name']} for the readiness gate") for obj in objects]
    for namespace, account in rbac.undefined_accounts(accounts, injected.present):
        name = f"{namespace}/{account}" if namespace else account
        said.append(
            ("note", f"the RoleBinding binds ServiceAccount {name}, which the input does not define: it must exist")
        )
    return manifest.documents(objects, after=injected.text), said


def _report(injected: Injected) -> None:
    for where in injected.changed:
        _say("", f"added the sidecar to {where}")
    for pod in injected.pods:
        for change in pod.outcome.changed:
            _say("warning", f"{pod.where}: {change}")
        if pod.outcome.skipped:
            _say("note", f"{pod.where}: not given the sidecar: {pod.outcome.skipped}")
    for budget in (name for name, allows in injected.budgets.items() if not allows):
        _say("warning", f"{budget} has no {POLICY}: {ALWAYS_ALLOW}; {WITHOUT_POLICY}")
    if injected.changed and not injected.budgets:
        _say("note", f"a PodDisruptionBudget over these pods needs {POLICY}: {ALWAYS_ALLOW}; {WITHOUT_POLICY}")
    if not injected.changed:
        _say("", "no engine without the sidecar found; the manifest is unchanged")


def main(args: argparse.Namespace) -> int:
    options = options_from(args)
    from inject import manifest  # PyYAML, from the node extra: spotdrain.cli says so when it is missing

    try:
        injected = manifest.inject_text(_read(args.filename), options)
    except (OSError, UnicodeDecodeError) as error:
        _say("error", f"cannot read {args.filename}: {error}")
        return 2
    except InjectError as error:
        _say("error", str(error))
        return 2
    if options.container is not None and options.container not in injected.containers:
        _say("error", f"no workload has a container {options.container!r}")
        return 2
    for problem in injected.invalid:
        _say("error" if args.strict else "warning", problem + ("" if args.strict else "; left as it is"))
    if injected.invalid and args.strict:
        return 2
    rbac, said = _gate_rbac(injected, options, emit=args.gate_rbac)
    sys.stdout.write(injected.text + rbac)
    _report(injected)
    for kind, text in said:
        _say(kind, text)
    return 0
