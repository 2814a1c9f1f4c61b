"""A load generator in a process of its own: streams to one URL, every event checked byte for byte, latencies out.

``python -m bench.relay_client SPEC``, SPEC being JSON ``{"url": ..., "count": N, "body": {...}, "spread_s": S}``:
``count`` streams, their starts spread evenly over ``spread_s``. Each event must be exactly the bytes
bench/sse_source.py wrote for that token (the proxy's client asked for no token ids, so it gets them as ``null``),
``max_tokens`` of them, then one ``data: [DONE]`` and nothing else but comment lines (the gateway marks where it
continued a stream with one; an SSE client skips them, as this one does). Prints one JSON object: ``latencies_ms`` (from
the time written in each event to its arrival here), ``streams``, ``exact`` (streams that were) and ``faults`` (the
first few that were not, said how). Reads lines with no JSON parsing, so the client costs the machine little.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.sse_source import chunk

_TEXT = b'"text":" '
_DONE = b"data: [DONE]\n"
FAULTS_KEPT = 5


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    streams: int = 0
    exact: int = 0
    faults: list[str] = field(default_factory=list)

    def fault(self, what: str) -> None:
        if len(self.faults) < FAULTS_KEPT:
            self.faults.append(what)


def _written_ns(line: bytes) -> int | None:
    start = line.find(_TEXT)
    end = line.find(b'"', start + len(_TEXT)) if start >= 0 else -1
    try:
        return int(line[start + len(_TEXT) : end]) if end > 0 else None
    except ValueError:
        return None


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any], tally: Tally) -> None:
    """Read one stream to its end; its latencies go into ``tally``, and whether it was exact."""
    tokens = int(body["max_tokens"])
    index = dones = 0
    fault = ""
    async with session.post(url, json=body) as response:
        if response.status != 200:
            tally.fault(f"HTTP {response.status}: {(await response.read())[:120]!r}")
            return
        async for line in response.content:
            now_ns = time.monotonic_ns()
            if line == b"\n" or line == b"\r\n" or line.startswith(b":"):
                continue
            if line == _DONE:
                dones += 1
                continue
            written = _written_ns(line)
            expected = chunk(index, last=index == tokens - 1, ids=False, written_ns=written or 0)
            if written is None or dones or line + b"\n" != expected:
                fault = fault or f"event {index}: {line[:160]!r}"
            else:
                tally.latencies_ms.append((now_ns - written) / 1e6)
            index += 1
    tally.streams += 1
    if index != tokens or dones != 1:
        fault = fault or f"{index} events of {tokens}, {dones} [DONE]"
    if fault:
        tally.fault(fault)
    else:
        tally.exact += 1


async def run(url: str, count: int, body: dict[str, Any], *, spread_s: float) -> Tally:
    tally = Tally()
    timeout = aiohttp.ClientTimeout(total=300, sock_read=60)

    async def started(session: aiohttp.ClientSession, index: int) -> None:
        await asyncio.sleep(spread_s * index / count)
        try:
            await one_stream(session, url, {**body, "stream": True}, tally)
        except (aiohttp.ClientError, TimeoutError) as error:
            tally.streams += 1
            tally.fault(f"{type(error).__name__}: {error}")

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await asyncio.gather(*(started(session, index) for index in range(count)))
    return tally


def main() -> None:
    spec = json.loads(sys.argv[1])
    tally = asyncio.run(run(spec["url"], int(spec["count"]), spec["body"], spread_s=float(spec["spread_s"])))
    json.dump(tally.__dict__, sys.stdout)


if __name__ == "__main__":
    main()
