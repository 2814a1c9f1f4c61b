"""The sock_diag request and answer, as include/uapi/linux/inet_diag.h and tcp.h lay them out."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.sockdiag import (
    INET_DIAG_INFO,
    NLMSG_DONE,
    NLMSG_ERROR,
    SOCK_DIAG_BY_FAMILY,
    DiagError,
    TcpConn,
    dump_request,
    parse_dump,
)

TCP_INFO_SIZE = 232  # struct tcp_info of Linux 6.x; older kernels send less, newer more


def tcp_info(conn: TcpConn, *, size: int = TCP_INFO_SIZE) -> bytes:
    info = bytearray(max(size, 136))
    struct.pack_into("=B", info, 0, 1)  # tcpi_state: ESTABLISHED
    struct.pack_into("=I", info, 44, conn.last_sent_ms or 0)
    struct.pack_into("=I", info, 52, conn.last_recv_ms or 0)
    struct.pack_into("=Q", info, 120, conn.bytes_acked or 0)
    struct.pack_into("=Q", info, 128, conn.bytes_received or 0)
    return bytes(info[:size])


def attribute(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def socket_message(conn: TcpConn, *, seq: int = 7, info: bytes | None = None, extra: bytes = b"") -> bytes:
    body = struct.pack(
        "=BBBB2H32xIQIIIII",
        socket.AF_INET,
        1,
        0,
        0,
        socket.htons(conn.local_port),
        socket.htons(conn.remote_port),
        0,
        conn.cookie,
        0,
        conn.recv_queue,
        conn.send_queue,
        1000,
        4242,
    )
    body += extra + (attribute(INET_DIAG_INFO, tcp_info(conn)) if info is None else info)
    return struct.pack("=IHHII", 16 + len(body), SOCK_DIAG_BY_FAMILY, 2, seq, 0) + body


def done(seq: int = 7) -> bytes:
    return struct.pack("=IHHIIi", 20, NLMSG_DONE, 2, seq, 0, 0)


u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
conns = st.builds(
    TcpConn,
    local_port=u16,
    remote_port=u16,
    recv_queue=u32,
    send_queue=u32,
    last_sent_ms=u32,
    last_recv_ms=u32,
    bytes_acked=st.integers(0, 2**64 - 1),
    bytes_received=st.integers(0, 2**64 - 1),
    cookie=st.integers(0, 2**64 - 1),
)


@given(st.lists(conns, max_size=5))
def test_every_socket_of_a_dump_is_read_back_as_the_kernel_sent_it(sent: list[TcpConn]) -> None:
    data = b"".join(socket_message(conn) for conn in sent) + done()
    assert parse_dump(data, seq=7) == (sent, True)


def test_a_dump_goes_on_until_its_done_message() -> None:
    conn = TcpConn(8000, 50000, 0, 0, 1, 2, 3, 4)
    assert parse_dump(socket_message(conn), seq=7) == ([conn], False)


def test_an_older_kernels_short_tcp_info_leaves_the_missing_fields_unknown() -> None:
    conn = TcpConn(8000, 50000, 0, 0, 10, 20, 30, 40)
    short = attribute(INET_DIAG_INFO, tcp_info(conn, size=104))  # Linux 3.x: no byte counts
    got, _ = parse_dump(socket_message(conn, info=short), seq=7)
    assert got == [TcpConn(8000, 50000, 0, 0, 10, 20, None, None)]


def test_no_tcp_info_attribute_leaves_every_time_unknown() -> None:
    conn = TcpConn(8000, 50000, 3, 0)
    assert parse_dump(socket_message(conn, info=b""), seq=7)[0] == [conn]


def test_other_attributes_are_skipped() -> None:
    conn = TcpConn(8000, 1, 0, 0, 5, 6, 7, 8)
    extra = attribute(4, b"cubic\0") + attribute(1, b"\x01\x02\x03")  # INET_DIAG_CONG, INET_DIAG_MEMINFO
    assert parse_dump(socket_message(conn, extra=extra), seq=7)[0] == [conn]


def test_messages_of_an_earlier_dump_are_skipped() -> None:
    conn = TcpConn(8000, 1, 0, 0, 5, 6, 7, 8)
    assert parse_dump(socket_message(conn, seq=1) + done(1) + done(), seq=7) == ([], True)


def test_a_refusal_raises_with_its_errno() -> None:
    error = struct.pack("=IHHIIi", 20, NLMSG_ERROR, 0, 7, 0, -1)
    with pytest.raises(DiagError) as raised:
        parse_dump(error, seq=7)
    assert raised.value.errno == 1


@pytest.mark.parametrize(
    "data",
    [
        struct.pack("=IHHII", 4, SOCK_DIAG_BY_FAMILY, 0, 7, 0),  # a length shorter than the header
        struct.pack("=IHHII", 400, SOCK_DIAG_BY_FAMILY, 0, 7, 0),  # longer than what came
        struct.pack("=IHHII", 20, SOCK_DIAG_BY_FAMILY, 0, 7, 0) + b"\0" * 4,  # shorter than inet_diag_msg
        socket_message(TcpConn(1, 2, 0, 0)) + b"\x01\x02",  # stray bytes
    ],
)
def test_malformed_answers_raise(data: bytes) -> None:
    with pytest.raises(DiagError):
        parse_dump(data, seq=7)


def test_an_attribute_overrunning_its_message_raises() -> None:
    bad = struct.pack("=HH", 64, INET_DIAG_INFO) + b"\0" * 8
    with pytest.raises(DiagError):
        parse_dump(socket_message(TcpConn(1, 2, 0, 0), info=bad), seq=7)


@given(st.binary(max_size=600), st.integers(0, 9))
def test_any_bytes_parse_or_raise_diag_error(data: bytes, seq: int) -> None:
    try:
        sockets, _ = parse_dump(data, seq=seq)
    except DiagError:
        return
    assert all(0 <= s.local_port <= 0xFFFF for s in sockets)


@given(st.lists(conns, min_size=1, max_size=3), st.binary(max_size=64), st.integers(0, 400))
def test_a_dump_with_bytes_changed_parses_or_raises_diag_error(sent: list[TcpConn], junk: bytes, at: int) -> None:
    data = bytearray(b"".join(socket_message(conn) for conn in sent) + done())
    data[at : at + len(junk)] = junk
    try:
        sockets, _ = parse_dump(bytes(data), seq=7)
    except DiagError:
        return
    assert len(sockets) <= len(data) // 88, "each socket takes a header and an inet_diag_msg at least"


def test_the_request_asks_for_established_sockets_on_the_port_with_tcp_info() -> None:
    request = dump_request(family=socket.AF_INET6, port=8000, seq=3)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", request)
    assert (length, kind, flags, seq) == (len(request), SOCK_DIAG_BY_FAMILY, 0x301, 3)
    family, protocol, ext, _, states = struct.unpack_from("=BBBBI", request, 16)
    assert (family, protocol, ext, states) == (socket.AF_INET6, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 2)
    # The filter: "sport == 8000", accepting by jumping to its end and rejecting by jumping one word past it.
    attr_len, attr_kind = struct.unpack_from("=HH", request, 72)
    code, yes, no, _, _, port = struct.unpack_from("=BBHBBH", request, 76)
    assert (attr_len, attr_kind, code, yes, no, port) == (12, 1, 11, 8, 12, 8000)
