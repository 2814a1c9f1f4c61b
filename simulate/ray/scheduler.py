"""vLLM's scheduler as the Ray app models it: a request waits until the next engine step schedules it, then gets one
token a step (``STEP_S``). Run by ``simulate.ray.app`` on real Ray and by the fake Ray node alike; standard library
only, since Ray's own Python imports it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from simulate.ray.server import STEP_S


@dataclass
class Request:
    tokens_left: int
    out: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)  # tokens left after each, then None


class Scheduler:
    """After each step with outputs, ``record(generated, running, waiting)``, as vLLM's stat logger records (nothing
    while the engine is idle)."""

    def __init__(self, record: Callable[[int, int, int], None]) -> None:
        self.record = record
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.work = asyncio.Event()

    def add(self, tokens: int) -> Request:
        request = Request(tokens_left=tokens)
        self.waiting.append(request)
        self.work.set()
        return request

    def abort(self, request: Request) -> None:
        """As vLLM's AsyncLLM.generate aborts a request whose caller was cancelled."""
        for queue in (self.waiting, self.running):
            if request in queue:
                queue.remove(request)

    async def run(self) -> None:
        while True:
            await self.work.wait()
            await asyncio.sleep(STEP_S)
            self.running += self.waiting
            self.waiting = []
            for request in self.running:
                request.tokens_left -= 1
                request.out.put_nowait(request.tokens_left)
            generated = len(self.running)
            for request in [r for r in self.running if r.tokens_left <= 0]:
                request.out.put_nowait(None)
                self.running.remove(request)
            self.record(generated, len(self.running), len(self.waiting))
            if not self.running and not self.waiting:
                self.work.clear()
