"""A token bucket shared by every API call of a program, so a thousand agents do not flood the API server."""

from __future__ import annotations

import asyncio


class RateLimiter:
    """``qps`` calls a second on average, up to ``burst`` at once after a quiet spell."""

    def __init__(self, *, qps: float, burst: int) -> None:
        self.qps = qps
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._stamp: float | None = None
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            loop = asyncio.get_running_loop()
            now = loop.time()
            if self._stamp is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.qps)
            self._stamp = now
            if self._tokens < 1:
                wait_s = (1 - self._tokens) / self.qps
                await asyncio.sleep(wait_s)
                self._stamp = loop.time()
                self._tokens = 1.0
            self._tokens -= 1
