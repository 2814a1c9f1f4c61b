"""The simulation's processes: started with their output tapped line by line, and all killed when it ends.

Each process's stdout and stderr go to a log file of its own; a JSON line (structlog's output) is also handed to the
process's listener, which is how the simulation learns what the programs did as they do it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()

Listener = Callable[[dict[str, Any]], None]


@dataclass
class Proc:
    name: str
    process: asyncio.subprocess.Process
    log_path: Path
    group: bool = False  # the leader of a process group of its own: signals go to the whole group
    reader: asyncio.Task[None] | None = None
    # What it printed first ("" if nothing): the AWS fake prints its endpoint there.
    first_line: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def signal(self, sig: signal.Signals) -> None:
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                if self.group:
                    os.killpg(self.process.pid, sig)
                else:
                    self.process.send_signal(sig)

    async def exited(self) -> int:
        """Wait until the process has exited and its output is read to the end; returns its exit code."""
        if self.reader is not None:
            await asyncio.shield(self.reader)
        return await self.process.wait()


async def _tap(proc: Proc, stream: asyncio.StreamReader, listener: Listener | None) -> None:
    """Copy the process's output to its log file, handing JSON lines to ``listener``; returns at end of output."""
    with proc.log_path.open("ab") as out:
        while line := await stream.readline():
            out.write(line)
            text = line.decode(errors="replace").strip()
            if not proc.first_line.done():
                proc.first_line.set_result(text)
            if listener is None or not text.startswith("{"):
                continue
            try:
                fields = json.loads(text)
            except ValueError:
                continue
            if isinstance(fields, dict):
                listener(fields)
    if not proc.first_line.done():
        proc.first_line.set_result("")  # it wrote nothing before exiting


class ProcessGroup:
    """Starts processes and owns them: ``close()`` kills whatever is still running."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    async def start(
        self,
        name: str,
        args: Sequence[str],
        *,
        listener: Listener | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        group: bool = False,
    ) -> Proc:
        """Start ``python <args>``; its output goes to ``<log_dir>/<name>.log`` and JSON lines to ``listener``.

        ``group`` starts it in a process group of its own, signalled as one (a program with worker processes)."""
        process = await asyncio.create_subprocess_exec(
            python,
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=group,
        )
        proc = Proc(name, process, self.log_dir / f"{name}.log", group=group)
        assert process.stdout is not None
        proc.reader = asyncio.create_task(_tap(proc, process.stdout, listener), name=f"tap-{name}")
        self.procs.append(proc)
        log.debug("simulation.process_started", process=name, pid=process.pid)
        return proc

    async def close(self) -> None:
        """Kill every process still running and wait for all of them; returns once none is left."""
        for proc in self.procs:
            proc.signal(signal.SIGKILL)
        for proc in self.procs:
            await proc.process.wait()
            if proc.reader is not None:
                with contextlib.suppress(Exception):
                    await proc.reader
            if not proc.first_line.done():
                proc.first_line.cancel()
