from __future__ import annotations

from pathlib import Path

from sidecar.netstat import established_connections, established_to_port

# Port 8000 is 1F40: one established server side, one listening socket, one TIME_WAIT, one client side to it.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000 20 4 30 10 -1
   2: 0100007F:1F40 0100007F:D2F2 06 00000000:00000000 03:00000F9D 00000000     0        0 0 3 0000
   3: 0100007F:D2F0 0100007F:1F40 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000 20 4 30 10 -1
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue
   0: 00000000000000000000000001000000:1F40 00000000000000000000000001000000:C350 01 00000000:00000000
"""


def test_only_established_server_side_rows_on_the_port_count() -> None:
    assert established_to_port(TCP, 8000) == 1
    assert established_to_port(TCP, 54000) == 1  # the client's own end (0xD2F0) is a row of its own
    assert established_to_port(TCP6, 8000) == 1
    assert established_to_port(TCP, 9000) == 0


def test_tables_are_summed_and_missing_ones_skipped(tmp_path: Path) -> None:
    (tmp_path / "tcp").write_text(TCP)
    (tmp_path / "tcp6").write_text(TCP6)
    assert established_connections(8000, (tmp_path / "tcp", tmp_path / "tcp6", tmp_path / "absent")) == 2


def test_no_readable_table_is_unknown_not_zero(tmp_path: Path) -> None:
    assert established_connections(8000, (tmp_path / "absent",)) is None


def test_garbage_rows_are_ignored() -> None:
    assert established_to_port("header\n\nshort row\n 1: x\n", 8000) == 0
