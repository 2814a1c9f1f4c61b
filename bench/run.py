"""Run every benchmark and print one JSON document: a list of {name, value, unit, target, passed, detail}."""

from __future__ import annotations

import asyncio
import sys

from bench import inflight_parse, sidecar
from bench.common import Result, report


def main() -> int:
    results: list[Result] = [inflight_parse.measure()]
    results += asyncio.run(sidecar.measure())
    report(results)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
