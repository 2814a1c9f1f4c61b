"""Established TCP connections to a local port, from /proc/net/tcp and /proc/net/tcp6 (pure parsing).

The tables say that a connection is open and what is queued on it, not when data last went either way: the fallback
where the kernel cannot be asked through sock_diag.
"""

from __future__ import annotations

from pathlib import Path

from sidecar.sockdiag import TcpConn

_ESTABLISHED = "01"
TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def _hex_pair(field: str) -> tuple[int, int] | None:
    """``a:b`` in hex, as the tables write queues and addresses; None where it does not parse."""
    first, _, second = field.rpartition(":")
    try:
        return int(first, 16), int(second, 16)
    except ValueError:
        return None


def established_to_port(table: str, port: int) -> list[TcpConn]:
    """The rows of a /proc/net/tcp table in state ESTABLISHED whose local port is ``port``. A row whose queues do not
    parse counts as bytes queued: it holds, as every open connection did before tcp_info could be read."""
    suffix = f":{port:04X}"
    found = []
    for row in table.splitlines()[1:]:
        fields = row.split(None, 5)
        if len(fields) >= 4 and fields[3] == _ESTABLISHED and fields[1].endswith(suffix):
            remote = _hex_pair(fields[2])
            send, recv = (len(fields) >= 5 and _hex_pair(fields[4])) or (1, 1)
            found.append(TcpConn(port, remote[1] if remote else 0, recv_queue=recv, send_queue=send))
    return found


def established_connections(port: int, tables: tuple[Path, ...] = TABLES) -> list[TcpConn] | None:
    """Connections clients hold open to ``port`` in this network namespace; None when no table is readable."""
    found: list[TcpConn] = []
    readable = False
    for table in tables:
        try:
            text = table.read_text()
        except OSError:
            continue
        readable = True
        found += established_to_port(text, port)
    return found if readable else None
