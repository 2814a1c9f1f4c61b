"""``spotdrain check``'s flags; each also reads ``SPOTDRAIN_<FLAG>``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from spotdrain.settings import add_flag, seconds


@dataclass(frozen=True)
class CheckSettings:
    kubeconfig: str | None
    context: str | None
    namespace: str | None
    selector: str
    output: str
    node: str | None
    agent_namespace: str
    timeout_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(
        parser,
        "--kubeconfig",
        aliases=("KUBECONFIG",),
        help="kubeconfig to read (else in-cluster, else ~/.kube/config)",
    )
    add_flag(parser, "--context", help="the kubeconfig context to use (default: its current context)")
    add_flag(parser, "--namespace", help="check only the workloads of this namespace (default: every namespace)")
    add_flag(
        parser, "--selector", default="", help="check only the pods with these labels (a=b,c!=d)", default_help="all"
    )
    add_flag(parser, "--output", default="text", choices=("text", "json"), help="text for people, json for CI")
    add_flag(parser, "--node", help="ask the node agent on this node what it sees, through the API server's pod proxy")
    add_flag(parser, "--agent-namespace", default="spotdrain", help="the node agent's namespace (for --node)")
    add_flag(parser, "--timeout", convert=seconds, default=10.0, help="seconds each API call may take")


def from_arguments(args: argparse.Namespace) -> CheckSettings:
    return CheckSettings(
        kubeconfig=args.kubeconfig,
        context=args.context,
        namespace=args.namespace,
        selector=args.selector,
        output=args.output,
        node=args.node,
        agent_namespace=args.agent_namespace,
        timeout_s=args.timeout,
    )
