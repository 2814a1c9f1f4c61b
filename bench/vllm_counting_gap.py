"""How long a vLLM server's in-flight gauges lag its streams: ``python -m bench.vllm_counting_gap --url URL``.

Streams one request at a time while another connection polls ``/metrics`` as fast as the server answers, and prints
JSON: per request, the seconds from sending it to the first page reading ``vllm:num_requests_running`` +
``vllm:num_requests_waiting`` >= 1 (``rise_s``), and from its ``[DONE]`` to the first page reading 0 again
(``fall_s``, negative when the gauges fell before the ``[DONE]`` arrived). A page's reading is dated when its answer
arrived, so both figures are upper bounds by up to one page's fetch (``poll_s``). The sidecar's confirmation window
for vLLM is set from the largest of these.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

from sidecar.engines import ENGINES, read_engine

TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass
class Gauges:
    """Every page read: (arrival time, in-flight), on the monotonic clock."""

    readings: list[tuple[float, int]] = field(default_factory=list)
    fetch_s: list[float] = field(default_factory=list)

    def first(self, *, after: float, rising: bool) -> float | None:
        for at, value in self.readings:
            if at > after and (value >= 1) == rising:
                return at
        return None


async def poll(session: aiohttp.ClientSession, url: str, gauges: Gauges, stop: asyncio.Event) -> None:
    """Reads the metrics page back to back until ``stop``; returns then."""
    while not stop.is_set():
        sent = time.monotonic()
        async with session.get(f"{url}/metrics", timeout=TIMEOUT) as response:
            page = await response.text()
        now = time.monotonic()
        gauges.readings.append((now, read_engine(page, ENGINES["vllm"]).in_flight))
        gauges.fetch_s.append(now - sent)


async def one(
    session: aiohttp.ClientSession, url: str, *, model: str, max_tokens: int, prompt: str
) -> dict[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    sent = time.monotonic()
    first = done = None
    async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data: ") and first is None:
                first = time.monotonic()
            if line == b"data: [DONE]":
                done = time.monotonic()
    if first is None or done is None:
        raise RuntimeError(f"the stream ended without [DONE] (HTTP {response.status})")
    return {"sent": sent, "first_chunk": first, "done": done}


async def measure(url: str, *, model: str, requests: int) -> dict[str, object]:
    gauges = Gauges()
    stop = asyncio.Event()
    rows = []
    async with aiohttp.ClientSession() as poller, aiohttp.ClientSession() as client:
        polling = asyncio.create_task(poll(poller, url, gauges, stop))
        await asyncio.sleep(0.5)
        for index in range(requests):
            max_tokens = (1, 4, 16, 64)[index % 4]
            prompt = " ".join(["the stream of tokens"] * (1 + index % 7 * 20))
            times = await one(client, url, model=model, max_tokens=max_tokens, prompt=prompt)
            await asyncio.sleep(0.3)  # let the gauges settle at 0 before the next request
            rise = gauges.first(after=times["sent"], rising=True)
            fall = gauges.first(after=rise or times["sent"], rising=False)
            rows.append(
                {
                    "max_tokens": max_tokens,
                    "prompt_words": len(prompt.split()),
                    "first_chunk_s": round(times["first_chunk"] - times["sent"], 4),
                    "rise_s": None if rise is None else round(rise - times["sent"], 4),
                    "fall_s": None if fall is None else round(fall - times["done"], 4),
                }
            )
        stop.set()
        await polling
    return _summary(rows, gauges)


def _summary(rows: list[dict[str, float | None]], gauges: Gauges) -> dict[str, object]:
    rises = [float(r["rise_s"]) for r in rows if isinstance(r["rise_s"], float)]
    falls = [float(r["fall_s"]) for r in rows if isinstance(r["fall_s"], float)]
    return {
        "requests": len(rows),
        "never_seen_counted": sum(r["rise_s"] is None for r in rows),
        "poll_s_median": round(statistics.median(gauges.fetch_s), 4),
        "rise_s": {"min": min(rises), "median": statistics.median(rises), "max": max(rises)},
        "fall_s": {"min": min(falls), "median": statistics.median(falls), "max": max(falls)},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.url, model=args.model, requests=args.requests)), indent=2))


if __name__ == "__main__":
    main()
