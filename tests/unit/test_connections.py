from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from sidecar.connections import EngineConnections, Look, Patience, holding, why_held
from sidecar.sockdiag import DiagError, TcpConn

PATIENCE = Patience(answered_ms=300, tied_ms=2000)
ms = st.integers(0, 10**7)
known = st.builds(
    TcpConn,
    local_port=st.just(8000),
    remote_port=st.integers(1, 65535),
    recv_queue=st.just(0),
    send_queue=st.just(0),
    last_sent_ms=ms,
    last_recv_ms=ms,
    bytes_acked=st.integers(0, 10**9),
    bytes_received=st.integers(0, 10**9),
)
patiences = st.builds(Patience, answered_ms=st.integers(0, 10**4), tied_ms=st.integers(0, 10**4))


def idle(*, quiet_ms: int) -> TcpConn:
    """A pooled connection after one answered request: the request came in, the response went out, nothing since."""
    return TcpConn(8000, 50000, 0, 0, last_sent_ms=quiet_ms, last_recv_ms=quiet_ms + 40, bytes_acked=900,
                   bytes_received=200)  # fmt: skip


def test_an_idle_pooled_connection_does_not_hold_once_quiet_past_the_window() -> None:
    assert why_held(idle(quiet_ms=301), PATIENCE) is None
    assert why_held(idle(quiet_ms=3_600_000), PATIENCE) is None  # Envoy's hour


def test_a_response_that_just_went_out_may_still_be_running() -> None:
    assert why_held(idle(quiet_ms=299), PATIENCE) == "response just sent"


def test_a_request_after_the_last_response_holds_however_long_ago() -> None:
    reused = replace(idle(quiet_ms=60_000), last_recv_ms=59_999, bytes_received=400)
    assert why_held(reused, PATIENCE) == "request after the last response"


def test_a_first_request_never_answered_holds_even_within_the_same_tick() -> None:
    fresh = TcpConn(8000, 50000, 0, 0, last_sent_ms=5000, last_recv_ms=5000, bytes_acked=0, bytes_received=300)
    assert why_held(fresh, PATIENCE) == "request never answered"


def test_bytes_in_or_out_hold() -> None:
    assert why_held(replace(idle(quiet_ms=9000), recv_queue=10), PATIENCE) == "bytes queued"
    assert why_held(replace(idle(quiet_ms=9000), send_queue=1), PATIENCE) == "bytes queued"


def test_data_both_ways_in_one_tick_holds_for_the_counting_gap_only() -> None:
    tied = replace(idle(quiet_ms=1999), last_recv_ms=1999)
    assert why_held(tied, PATIENCE) == "same tick"
    assert why_held(replace(tied, last_sent_ms=2000, last_recv_ms=2000), PATIENCE) is None


def test_an_opened_connection_that_never_carried_a_byte_holds_only_briefly() -> None:
    opened = TcpConn(8000, 50000, 0, 0, last_sent_ms=50, last_recv_ms=50, bytes_acked=0, bytes_received=0)
    assert why_held(opened, PATIENCE) == "same tick"
    assert why_held(replace(opened, last_sent_ms=2500, last_recv_ms=2500), PATIENCE) is None


def test_without_tcp_info_every_connection_holds_as_before() -> None:
    assert why_held(TcpConn(8000, 50000, 0, 0), PATIENCE) == "no tcp_info"


@given(known, patiences)
def test_data_in_after_data_out_always_holds(conn: TcpConn, patience: Patience) -> None:
    assert conn.last_recv_ms is not None
    assert conn.last_sent_ms is not None
    if conn.last_recv_ms < conn.last_sent_ms:
        assert why_held(conn, patience) is not None


@given(known, patiences, st.integers(1, 2**31), st.integers(1, 2**31))
def test_queued_bytes_always_hold(conn: TcpConn, patience: Patience, recv: int, send: int) -> None:
    assert why_held(replace(conn, recv_queue=recv), patience) is not None
    assert why_held(replace(conn, send_queue=send), patience) is not None


@given(known, patiences)
def test_answered_and_quiet_past_both_windows_never_holds(conn: TcpConn, patience: Patience) -> None:
    assert conn.last_recv_ms is not None
    assert conn.last_sent_ms is not None
    answered = conn.last_recv_ms >= conn.last_sent_ms and not (conn.bytes_received and conn.bytes_acked == 0)
    if answered and conn.last_sent_ms >= max(patience.answered_ms, patience.tied_ms):
        assert why_held(conn, patience) is None


def test_holding_counts_by_reason() -> None:
    conns = [idle(quiet_ms=5000), idle(quiet_ms=10), idle(quiet_ms=20), TcpConn(8000, 1, 4, 0)]
    assert holding(conns, PATIENCE)[0] == {"response just sent": 2, "bytes queued": 1}


TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue
   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000
"""


def test_where_sock_diag_fails_the_tables_are_read_and_the_change_is_logged_once(tmp_path: Path) -> None:
    (tmp_path / "tcp").write_text(TABLE)
    answers: list[list[TcpConn] | Exception] = [PermissionError(1, "denied"), DiagError("odd"), [idle(quiet_ms=5)]]

    def dump(port: int) -> list[TcpConn]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    source = EngineConnections(dump=dump, tables=(tmp_path / "tcp",))
    with capture_logs() as logs:
        first, second, third = source(8000), source(8000), source(8000)
    assert first == second == [TcpConn(8000, 0xD2F0, 0, 0)]
    assert third == [idle(quiet_ms=5)]
    assert [(e["event"], e["source"]) for e in logs] == [
        ("engine.connections_unjudged", "/proc/net/tcp"),
        ("engine.connections_judged", "sock_diag"),
    ]
    assert "PermissionError" in logs[0]["error"]


def tie(*, at_ms: int, received: int, acked: int) -> TcpConn:
    return TcpConn(8000, 50000, 0, 0, at_ms, at_ms, bytes_acked=acked, bytes_received=received, cookie=7)


def test_a_keep_alive_health_check_answered_within_a_tick_stops_holding_from_the_next_look_on() -> None:
    first = tie(at_ms=10, received=100, acked=50)
    reasons, looked = holding([first], PATIENCE)
    assert reasons == {"same tick": 1}, "the first look cannot tell"
    checked_again = tie(at_ms=5, received=200, acked=100)  # one more request and its answer, in one tick
    reasons, looked = holding([checked_again], PATIENCE, looked)
    assert reasons == {}
    assert holding([checked_again], PATIENCE, looked)[0] == {}, "nothing since an idle look: still idle"
    assert holding([tie(at_ms=1, received=300, acked=150)], PATIENCE, looked)[0] == {}


def test_a_tie_after_a_look_that_saw_a_response_under_way_keeps_holding() -> None:
    streaming = TcpConn(8000, 50000, 0, 0, 5, 900, bytes_acked=4000, bytes_received=100, cookie=7)
    reasons, looked = holding([streaming], PATIENCE)
    assert reasons == {"response just sent": 1}
    reused = tie(at_ms=3, received=200, acked=5000)  # [DONE], and a new request in the same tick
    assert holding([reused], PATIENCE, looked)[0] == {"same tick": 1}


def test_a_look_at_another_socket_on_the_same_port_tells_nothing() -> None:
    _, looked = holding([replace(tie(at_ms=10, received=100, acked=50), cookie=8)], PATIENCE)
    assert holding([tie(at_ms=5, received=200, acked=100)], PATIENCE, looked)[0] == {"same tick": 1}


@given(known, known, patiences, st.sampled_from([None, "same tick", "response just sent", "bytes queued"]))
def test_a_request_after_the_last_response_holds_whatever_an_earlier_look_found(
    conn: TcpConn, earlier: TcpConn, patience: Patience, reason: str | None
) -> None:
    assert conn.last_recv_ms is not None
    assert conn.last_sent_ms is not None
    if conn.last_recv_ms < conn.last_sent_ms:
        assert why_held(conn, patience, Look(replace(earlier, cookie=conn.cookie), reason)) is not None
