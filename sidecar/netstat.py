"""Established TCP connections to a local port, from /proc/net/tcp and /proc/net/tcp6 (pure parsing)."""

from __future__ import annotations

from pathlib import Path

_ESTABLISHED = "01"
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def established_to_port(table: str, port: int) -> int:
    """Count rows of a /proc/net/tcp table in state ESTABLISHED whose local port is ``port``."""
    suffix = f":{port:04X}"
    count = 0
    for row in table.splitlines()[1:]:
        fields = row.split(None, 4)
        if len(fields) >= 4 and fields[3] == _ESTABLISHED and fields[1].endswith(suffix):
            count += 1
    return count


def established_connections(port: int, tables: tuple[Path, ...] = TABLES) -> int | None:
    """Connections clients hold open to ``port`` in this network namespace; None when no table is readable."""
    total = 0
    readable = False
    for table in tables:
        try:
            text = table.read_text()
        except OSError:
            continue
        readable = True
        total += established_to_port(text, port)
    return total if readable else None
