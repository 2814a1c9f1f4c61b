"""The kernel's own account of each TCP connection to a local port, through NETLINK_SOCK_DIAG (what ``ss -ti``
reads): queues, when data last went each way, and byte counts. Building the request and parsing the answer are
pure; ``dump`` is the only I/O, one netlink socket under a timeout.

Linux answers a dump of TCP sockets, with their ``struct tcp_info``, to any user of the network namespace: no
capability is needed (only socket marks and cgroup filters are kept for CAP_NET_ADMIN). Layouts are those of
include/uapi/linux/inet_diag.h, sock_diag.h, netlink.h and tcp.h.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
INET_DIAG_INFO = 2  # the attribute carrying struct tcp_info
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_S_EQ = 11
TCP_ESTABLISHED = 1

_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBBI48x")  # struct inet_diag_req_v2: family, protocol, ext, pad, states, id (ignored)
_MESSAGE = struct.Struct("=BBBB2H32xIQIIIII")  # struct inet_diag_msg (ports big-endian, swapped below)
_ATTR = struct.Struct("=HH")  # struct rtattr / nlattr: len, type
# Offsets into struct tcp_info of the fields read here; a kernel older than a field sends a shorter struct.
_LAST_DATA_SENT, _LAST_DATA_RECV = 44, 52
_BYTES_ACKED, _BYTES_RECEIVED = 120, 128


class DiagError(ValueError):
    """The answer is not a well-formed sock_diag dump, or the kernel refused the request (``errno`` set)."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True)
class TcpConn:
    """One connection as the kernel sees it from the engine's side. Times are milliseconds ago; None where the
    kernel did not say (no tcp_info, or an older struct)."""

    local_port: int
    remote_port: int
    recv_queue: int  # bytes that arrived and the engine has not read
    send_queue: int  # bytes the engine wrote that the client has not acknowledged
    last_sent_ms: int | None = None
    last_recv_ms: int | None = None
    bytes_acked: int | None = None  # of what the engine sent
    bytes_received: int | None = None
    cookie: int = 0  # the kernel's id of the socket: the same connection on the next look


def dump_request(*, family: int, port: int, seq: int) -> bytes:
    """A dump of the ESTABLISHED TCP sockets of ``family`` whose local port is ``port``, with their tcp_info.

    The port is matched in the kernel by a one-instruction filter (``sport == port``: jump past the end to accept,
    one word beyond it to reject), so a node's other sockets are never copied out.
    """
    condition = struct.pack("=BBH", INET_DIAG_BC_S_EQ, 8, 12) + struct.pack("=BBH", 0, 0, port)
    attribute = _ATTR.pack(_ATTR.size + len(condition), INET_DIAG_REQ_BYTECODE) + condition
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, 1 << TCP_ESTABLISHED) + attribute
    return _HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + body


def _u32(data: bytes, offset: int) -> int | None:
    return struct.unpack_from("=I", data, offset)[0] if len(data) >= offset + 4 else None


def _u64(data: bytes, offset: int) -> int | None:
    return struct.unpack_from("=Q", data, offset)[0] if len(data) >= offset + 8 else None


def _tcp_info(attributes: bytes) -> bytes:
    """The payload of the INET_DIAG_INFO attribute, or nothing."""
    offset = 0
    while offset + _ATTR.size <= len(attributes):
        length, kind = _ATTR.unpack_from(attributes, offset)
        if length < _ATTR.size or offset + length > len(attributes):
            raise DiagError(f"an attribute of {length} bytes overruns its message")
        if kind & 0x3FFF == INET_DIAG_INFO:  # the top bits are netlink's nested and byte-order flags
            return attributes[offset + _ATTR.size : offset + length]
        offset += (length + 3) & ~3
    return b""


def parse_socket(payload: bytes) -> TcpConn:
    """One SOCK_DIAG_BY_FAMILY message's payload: struct inet_diag_msg, then its attributes."""
    if len(payload) < _MESSAGE.size:
        raise DiagError(f"a socket message of {len(payload)} bytes is shorter than inet_diag_msg")
    _, _, _, _, sport, dport, _, cookie, _, rqueue, wqueue, _, _ = _MESSAGE.unpack_from(payload)
    info = _tcp_info(payload[_MESSAGE.size :])
    return TcpConn(
        local_port=socket.ntohs(sport),
        remote_port=socket.ntohs(dport),
        recv_queue=rqueue,
        send_queue=wqueue,
        last_sent_ms=_u32(info, _LAST_DATA_SENT),
        last_recv_ms=_u32(info, _LAST_DATA_RECV),
        bytes_acked=_u64(info, _BYTES_ACKED),
        bytes_received=_u64(info, _BYTES_RECEIVED),
        cookie=cookie,
    )


def parse_dump(data: bytes, *, seq: int) -> tuple[list[TcpConn], bool]:
    """The sockets in one datagram of a dump answering ``seq``, and whether it was the last; raises DiagError."""
    sockets: list[TcpConn] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, got_seq, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise DiagError(f"a netlink message of {length} bytes overruns the {len(data)} received")
        payload = data[offset + _HEADER.size : offset + length]
        offset += (length + 3) & ~3
        if got_seq != seq:
            continue  # the rest of an earlier dump that timed out
        if kind == NLMSG_DONE:
            return sockets, True
        if kind == NLMSG_ERROR:
            errno = -struct.unpack_from("=i", payload)[0] if len(payload) >= 4 else 0
            raise DiagError(f"the kernel refused the socket dump: errno {errno}", errno=errno)
        if kind == SOCK_DIAG_BY_FAMILY:
            sockets.append(parse_socket(payload))
    if offset < len(data):
        raise DiagError(f"{len(data) - offset} stray bytes after the last message")
    return sockets, False


def dump(
    port: int, *, timeout_s: float, families: tuple[int, ...] = (socket.AF_INET, socket.AF_INET6)
) -> list[TcpConn]:
    """Every ESTABLISHED TCP connection whose local port is ``port`` in this network namespace.

    Raises OSError where the kernel offers no sock_diag (another OS, a sandbox such as gVisor, a seccomp profile
    that refuses netlink), DiagError on an answer that makes no sense, TimeoutError after ``timeout_s`` in all.
    """
    give_up = time.monotonic() + timeout_s
    found: list[TcpConn] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as sock:
        for seq, family in enumerate(families, start=1):
            sock.settimeout(max(0.001, give_up - time.monotonic()))
            sock.send(dump_request(family=family, port=port, seq=seq))
            done = False
            while not done:
                sock.settimeout(max(0.001, give_up - time.monotonic()))
                try:
                    part, done = parse_dump(sock.recv(65536), seq=seq)
                except DiagError as error:
                    if family == socket.AF_INET6 and error.errno in _NO_FAMILY:
                        break  # a kernel built without IPv6: nobody can be connected over it
                    raise
                found += part
    return found


_NO_FAMILY = {97, 2}  # EAFNOSUPPORT, ENOENT (no inet_diag handler for the family)
