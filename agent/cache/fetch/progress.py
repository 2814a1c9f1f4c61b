"""What a fetch tells the person or the log watching it: a one-line bar on a terminal, a log line every few seconds
otherwise, and one summary line at the end."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import structlog

log = structlog.get_logger()
BAR_INTERVAL_S = 0.25
MB = 1_000_000


def human(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Bytes written so far against the total; bytes a resumed fetch had already are counted apart from the rate."""

    def __init__(
        self, *, total_bytes: int, resumed_bytes: int, files: int, clock: Callable[[], float] = time.monotonic
    ):
        self.total_bytes = total_bytes
        self.resumed_bytes = resumed_bytes
        self.files = files
        self.fetched_bytes = 0
        self.clock = clock
        self.started = clock()

    def add(self, count: int) -> None:
        self.fetched_bytes += count

    def rate(self, now: float) -> float:
        return self.fetched_bytes / max(now - self.started, 1e-6)

    def line(self, now: float) -> str:
        done = self.resumed_bytes + self.fetched_bytes
        share = done / self.total_bytes if self.total_bytes else 1.0
        rate = self.rate(now)
        eta = (self.total_bytes - done) / rate if rate > 0 else float("inf")
        width = 24
        bar = "#" * int(share * width)
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        return (
            f"[{bar:<{width}}] {share:4.0%} {human(done)} / {human(self.total_bytes)}  {human(rate)}/s  ETA {eta_text}"
        )

    def fields(self, now: float) -> dict[str, Any]:
        seconds = now - self.started
        return {
            "bytes": self.resumed_bytes + self.fetched_bytes,
            "total_bytes": self.total_bytes,
            "fetched_bytes": self.fetched_bytes,
            "resumed_bytes": self.resumed_bytes,
            "seconds": round(seconds, 3),
            "mb_per_s": round(self.fetched_bytes / MB / max(seconds, 1e-6), 1),
            "files": self.files,
        }


async def reporter(progress: Progress, *, name: str, interval_s: float, stream: TextIO | None = None) -> None:
    """Shows progress until cancelled: a bar redrawn in place when ``stream`` (stderr) is a terminal, else a
    ``cache.fetch_progress`` log line every ``interval_s``."""
    out = sys.stderr if stream is None else stream
    tty = out.isatty()
    try:
        while True:
            await asyncio.sleep(BAR_INTERVAL_S if tty else interval_s)
            now = progress.clock()
            if tty:
                out.write("\r" + progress.line(now) + "\x1b[K")
                out.flush()
            else:
                log.info("cache.fetch_progress", name=name, **progress.fields(now))
    finally:
        if tty:
            out.write("\r" + progress.line(progress.clock()) + "\x1b[K\n")
            out.flush()
