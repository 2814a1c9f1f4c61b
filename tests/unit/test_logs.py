"""Log lines as a cluster's log collector reads them: processes that share one stderr (the gateway's workers, in one
container) never merge their JSON lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

LINES = 2000
WRITER = f"""
import structlog
from spotdrain.logs import configure_logging
configure_logging(json=True)
log = structlog.get_logger()
for n in range({LINES}):
    log.info("line.written", n=n)
"""


def test_processes_sharing_stderr_write_whole_lines() -> None:
    """Two processes log to one pipe at once; each line read back must be one whole JSON event (print() wrote the
    event and its newline apart, and about one line in seven merged with the other process's)."""
    read, write = os.pipe()
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER], stderr=write, stdout=subprocess.DEVNULL) for _ in range(2)
    ]
    os.close(write)
    with open(read, encoding="utf-8") as pipe:
        lines = pipe.read().splitlines()
    for writer in writers:
        assert writer.wait(timeout=60) == 0
    broken = [line for line in lines if not _event(line)]
    assert not broken, f"{len(broken)} of {len(lines)} lines are not one event each: {broken[:3]}"
    assert len(lines) == 2 * LINES


def _event(line: str) -> bool:
    try:
        return bool(json.loads(line).get("event") == "line.written")
    except ValueError:
        return False
