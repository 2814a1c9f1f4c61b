"""``spotdrain check``: read the cluster, judge the install, print the findings; the exit status says how it went."""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiohttp

from check.access import load
from check.findings import Report
from check.reading import Reader, Scope, Unreachable, read_cluster
from check.report import as_json, as_text
from check.rules import evaluate
from check.settings import CheckSettings, from_arguments
from spotdrain.clock import utcnow
from spotdrain.kube_rest import Access


async def inspect(access: Access, scope: Scope, *, timeout_s: float) -> Report:
    """The report for the cluster behind ``access``; an unreachable cluster is a report too (exit status 2)."""
    async with aiohttp.ClientSession() as session:
        try:
            snapshot = await read_cluster(Reader(session, access, timeout_s=timeout_s), scope, now=utcnow())
        except Unreachable as error:
            return Report((), unreachable=str(error))
    return evaluate(snapshot)


async def run(settings: CheckSettings) -> int:
    access = await load(settings.kubeconfig, context=settings.context)
    if settings.node is not None:
        from check.node import show_node

        return await show_node(access, settings)
    report = await inspect(access, Scope(settings.namespace, settings.selector), timeout_s=settings.timeout_s)
    sys.stdout.write(as_json(report) + "\n" if settings.output == "json" else as_text(report))
    if report.unreachable is not None and settings.output == "json":
        print(f"spotdrain check: could not read the cluster: {report.unreachable}", file=sys.stderr)
    return report.exit_code


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(from_arguments(args)))
