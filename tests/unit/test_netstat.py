from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from sidecar.netstat import established_connections, established_to_port
from sidecar.sockdiag import TcpConn

# Port 8000 is 1F40: one established server side, one listening socket, one TIME_WAIT, one client side to it.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000010 00:00000000 00000000     0        0 2 1 0000 20 4 30 10 -1
   2: 0100007F:1F40 0100007F:D2F2 06 00000000:00000000 03:00000F9D 00000000     0        0 0 3 0000
   3: 0100007F:D2F0 0100007F:1F40 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000 20 4 30 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000001000000:1F40 00000000000000000000000001000000:C350 01 00000020:00000000
"""


def test_only_established_server_side_rows_on_the_port_are_listed_with_their_queues() -> None:
    assert established_to_port(TCP, 8000) == [TcpConn(8000, 0xD2F0, recv_queue=16, send_queue=0)]
    assert established_to_port(TCP, 54000) == [TcpConn(54000, 8000, recv_queue=0, send_queue=0)]  # the client's end
    assert established_to_port(TCP6, 8000) == [TcpConn(8000, 50000, recv_queue=0, send_queue=32)]
    assert established_to_port(TCP, 9000) == []


def test_tables_are_joined_and_missing_ones_skipped(tmp_path: Path) -> None:
    (tmp_path / "tcp").write_text(TCP)
    (tmp_path / "tcp6").write_text(TCP6)
    found = established_connections(8000, (tmp_path / "tcp", tmp_path / "tcp6", tmp_path / "absent"))
    assert found is not None
    assert [c.remote_port for c in found] == [0xD2F0, 50000]


def test_no_readable_table_is_unknown_not_zero(tmp_path: Path) -> None:
    assert established_connections(8000, (tmp_path / "absent",)) is None


def test_garbage_rows_are_ignored_and_unreadable_queues_hold() -> None:
    assert established_to_port("header\n\nshort row\n 1: x\n", 8000) == []
    row = "h\n 1: 0100007F:1F40 zz 01 what\n"
    assert established_to_port(row, 8000) == [TcpConn(8000, 0, recv_queue=1, send_queue=1)]


@given(st.text())
def test_any_text_gives_rows_on_the_port_or_none(text: str) -> None:
    assert all(conn.local_port == 8000 for conn in established_to_port(text, 8000))
