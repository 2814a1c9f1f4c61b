"""Root tasks of a program: each runs inside a guard, the first to end stops the program, shutdown is ordered."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Collection, Coroutine, Sequence
from typing import Any

import structlog

log = structlog.get_logger()

Role = tuple[str, Coroutine[Any, Any, None]]


class Supervisor:
    """Runs named long-running coroutines until ``stop`` is set, then cancels them in reverse start order."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.failed: list[str] = []

    async def _guard(self, name: str, coro: Coroutine[Any, Any, None], *, one_shot: bool) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            log.debug("task.cancelled", task=name)
            raise
        except Exception:
            log.exception("task.failed", task=name)
            self.failed.append(name)
        else:
            if one_shot:
                log.debug("task.done", task=name)
                return
            if not self.stop.is_set():
                log.warning("task.finished_unexpectedly", task=name)
        self.stop.set()

    async def run(self, roles: Sequence[Role], *, one_shot: Collection[str] = ()) -> bool:
        """Start ``roles`` in order and return once all have ended; True unless one of them failed.

        A role named in ``one_shot`` may finish its work and return without stopping the program.
        """
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(self._guard(name, coro, one_shot=name in one_shot), name=name) for name, coro in roles
            ]
            await self.stop.wait()
            # Later roles depend on earlier ones (the probe server starts first and must answer until the end).
            for task in reversed(tasks):
                task.cancel()
                await asyncio.wait([task])
        return not self.failed


def on_signals(handler: Any, *signals: signal.Signals) -> None:
    """Route the given signals to ``handler`` on the running loop; handlers only set events."""
    loop = asyncio.get_running_loop()
    for sig in signals:
        loop.add_signal_handler(sig, handler, sig)
