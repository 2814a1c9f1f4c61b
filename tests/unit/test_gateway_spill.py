"""Which worker takes new connections (gateway.spill): the first alone until it is past ``--spill-at``, the next while
each before it is, a worker not heard from as one past it; the board the workers share, and the parent's readiness
from it."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import Gauge

from gateway import server as server_module
from gateway.settings import from_arguments
from gateway.spill import STALE_S, Board, Seen, listening_socket, serves, sheds
from gateway.workers import ready_check
from spotdrain.cli import build_parser
from spotdrain.metrics import CollectorRegistry

NOW = 1000.0


def fresh(busy: float, *, serving: bool = True) -> Seen:
    return Seen(NOW - 0.1, busy, serving)


GONE = Seen(NOW - STALE_S - 0.1, 0.0, True)  # killed, or starting: its last entry is old


@pytest.mark.parametrize(
    ("seen", "serving", "expected"),
    [
        ([fresh(0.9)], False, [True]),  # the first always takes connections
        ([fresh(0.1), fresh(0.0, serving=False)], False, [True, False]),
        ([fresh(0.6), fresh(0.0, serving=False)], False, [True, True]),  # the first is past 0.5
        ([fresh(0.4), fresh(0.0)], True, [True, True]),  # past STAY of 0.5: the second goes on
        ([fresh(0.2), fresh(0.0)], True, [True, False]),  # under it: the second leaves
        ([GONE, fresh(0.0, serving=False)], False, [True, True]),  # the first not heard from
        ([fresh(0.6), fresh(0.1), fresh(0.0, serving=False)], False, [True, True, False]),
        ([fresh(0.6), fresh(0.7), fresh(0.0, serving=False)], False, [True, True, True]),
    ],
)
def test_a_worker_takes_connections_while_every_worker_before_it_is_full(
    seen: list[Seen], serving: bool, expected: list[bool]
) -> None:
    assert [serves(i, seen, NOW, spill_at=0.5, serving=serving) for i in range(len(seen))] == expected


@given(st.lists(st.floats(0, 4), min_size=1, max_size=8), st.booleans())
def test_at_spill_at_0_every_worker_takes_connections(busy: list[float], serving: bool) -> None:
    seen = [fresh(b) for b in busy]
    assert all(serves(i, seen, NOW, spill_at=0.0, serving=serving) for i in range(len(seen)))
    assert not any(sheds(i, seen, NOW, spill_at=0.0) for i in range(len(seen)))


@pytest.mark.parametrize(
    ("seen", "index", "expected"),
    [
        ([fresh(0.8), fresh(0.1)], 0, True),  # past the bound, and the next has room
        ([fresh(0.4), fresh(0.1)], 0, False),  # not past it
        ([fresh(0.8), fresh(0.6)], 0, False),  # the next is past it too: a new connection would cost both
        ([fresh(0.8), fresh(0.1, serving=False)], 0, False),  # the next does not take connections (yet)
        ([fresh(0.8), GONE], 0, False),
        ([fresh(0.1), fresh(0.8)], 1, False),  # the last has no next
    ],
)
def test_a_worker_past_the_bound_ends_its_connections_only_where_the_next_has_room(
    seen: list[Seen], index: int, expected: bool
) -> None:
    assert sheds(index, seen, NOW, spill_at=0.5) is expected


def test_the_board_is_shared_through_its_file_and_a_cleared_entry_is_not_heard_from(tmp_path: Path) -> None:
    path = tmp_path / "board"
    parent = Board.create(path, 3)
    assert parent.read() == [Seen(0.0, 0.0, False)] * 3
    worker = Board(path)  # another process maps the same file
    worker.write(1, Seen(NOW, 0.25, True))
    assert parent.read()[1] == Seen(NOW, 0.25, True)
    parent.clear(1)
    assert worker.read()[1].stale(NOW)


def test_the_spill_at_flag_takes_a_share_of_a_cpu() -> None:
    parse = build_parser().parse_args
    argv = ["gateway", "--backend", "http://127.0.0.1:8000"]
    assert from_arguments(parse(argv)).spill_at == 0.5
    assert from_arguments(parse([*argv, "--spill-at", "0"])).spill_at == 0.0
    with pytest.raises(SystemExit):
        parse([*argv, "--spill-at", "1.5"])


def test_the_shared_socket_listens_passes_to_a_child_and_bounds_unsent_bytes() -> None:
    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        assert sock.get_inheritable()
        unsent = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT)
        assert unsent == server_module.KERNEL_UNSENT_BYTES
        with pytest.raises(OSError, match="in use"):  # the port is taken: the parent says so at its start
            listening_socket("127.0.0.1", sock.getsockname()[1])
    finally:
        sock.close()


def test_the_parent_is_ready_once_a_worker_sees_a_ready_backend_and_one_takes_connections(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    backends = Gauge("spotdrain_gateway_backends_ready", "ready backends", registry=registry)
    board = Board.create(tmp_path / "board", 2)
    assert ready_check(registry, board) == (False, "no backend ready")
    backends.set(1)
    assert ready_check(registry, board) == (False, "1 backends ready, no worker taking connections")
    board.write(1, Seen(time.monotonic(), 0.0, serving=True))
    assert ready_check(registry, board) == (True, "1 backends ready")
    board.write(1, Seen(time.monotonic() - STALE_S - 1, 0.0, serving=True))  # not heard from since
    assert ready_check(registry, board)[0] is False
