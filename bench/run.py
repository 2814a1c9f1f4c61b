"""Run every benchmark and print one JSON document: a list of {name, value, unit, target, passed, detail}.

Exits non-zero when a measured target is missed; a benchmark that could not run here is reported skipped, with its
reason, and fails nothing. ``python -m bench.run NAME ...`` runs only the named modules.
"""

from __future__ import annotations

import asyncio
import sys

from bench import (
    burst,
    cache,
    cache_fetch,
    faults,
    fleet,
    footprint,
    gateway,
    gateway_chunk,
    gateway_peers,
    gateway_streams,
    inflight_parse,
    node,
    prestop,
    sidecar,
    waiting,
    webhook,
)
from bench.common import Result, missed, report


async def run(names: set[str]) -> list[Result]:
    results: list[Result] = []
    if not names or "inflight_parse" in names:
        results.append(inflight_parse.measure())
    if not names or "prestop" in names:
        results += prestop.measure()
    modules = (
        ("sidecar", sidecar),
        ("node", node),
        ("burst", burst),
        ("cache", cache),
        ("cache_fetch", cache_fetch),
        ("fleet", fleet),
        ("waiting", waiting),
        ("faults", faults),
        ("gateway", gateway),
        ("gateway-chunk", gateway_chunk),
        ("gateway-peers", gateway_peers),
        ("gateway-streams", gateway_streams),
        ("webhook", webhook),
        ("footprint", footprint),
    )
    for name, module in modules:
        if not names or name in names:
            results += await module.measure()
    return results


def main() -> int:
    results = asyncio.run(run(set(sys.argv[1:])))
    report(results)
    return 1 if missed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
