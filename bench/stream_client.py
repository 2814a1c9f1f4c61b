"""A benchmark client in a process of its own: streams to several URLs at once, each chunk's delivery latency out.

``python -m bench.stream_client SPEC`` where SPEC is JSON ``{"targets": [[url, count], ...], "body": {...},
"spread_s": S}``: every stream starts within ``spread_s`` (evenly, the targets interleaved), and the latencies
(milliseconds from the time written in a chunk by bench/sse_source.py to its arrival here) print as one JSON object,
``{url: [ms, ...]}``. Several of these share a run's streams, so no one client's event loop is the queue that the
tail of both the direct and the gateway figures measures.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp

from simulate.fakes.sse_client import Streamed, read_stream


def delivery_ms(streamed: Streamed) -> list[float]:
    return [
        (arrived - int(chunk["choices"][0]["text"]) / 1e9) * 1000
        for chunk, arrived in zip(streamed.chunks, streamed.arrivals, strict=True)
    ]


async def run(targets: list[tuple[str, int]], body: dict[str, Any], spread_s: float) -> dict[str, list[float]]:
    plan = sorted(
        ((index / count, url) for url, count in targets for index in range(count)), key=lambda start: start[0]
    )

    async def one(session: aiohttp.ClientSession, at: float, url: str) -> tuple[str, Streamed]:
        await asyncio.sleep(spread_s * at)
        return url, await read_stream(url, body, session=session)

    out: dict[str, list[float]] = {url: [] for url, _ in targets}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for url, streamed in await asyncio.gather(*(one(session, at, url) for at, url in plan)):
            out[url] += delivery_ms(streamed)
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    targets = [(str(url), int(count)) for url, count in spec["targets"]]
    json.dump(asyncio.run(run(targets, spec["body"], float(spec["spread_s"]))), sys.stdout)


if __name__ == "__main__":
    main()
