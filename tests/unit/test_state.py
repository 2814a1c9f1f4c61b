from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.state import (
    Drain,
    Outcome,
    Phase,
    Reading,
    advance,
    next_poll_delay,
    observe,
    streams_cut,
)

STALL_S = 10.0
CONFIRM_S = 1.0


def run(readings: list[Reading], *, deadline: float = 100.0) -> tuple[Drain, Outcome | None, int]:
    drain = Drain(started_at=0.0, deadline=deadline)
    for index, reading in enumerate(readings):
        drain, outcome = observe(drain, reading, stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
        if outcome is not None:
            return drain, outcome, index
    return drain, None, len(readings)


def test_phases_only_move_forward_one_step() -> None:
    assert advance(Phase.SERVING, Phase.DRAINING) is Phase.DRAINING
    assert advance(Phase.DRAINING, Phase.DRAINED) is Phase.DRAINED
    assert advance(Phase.SERVING, Phase.DRAINED) is Phase.SERVING
    assert advance(Phase.DRAINED, Phase.SERVING) is Phase.DRAINED
    assert advance(Phase.DRAINING, Phase.SERVING) is Phase.DRAINING


@given(st.lists(st.sampled_from(list(Phase))))
def test_no_sequence_of_requests_moves_a_phase_backwards(requests: list[Phase]) -> None:
    order = list(Phase)
    phase = Phase.SERVING
    for to in requests:
        after = advance(phase, to)
        assert order.index(after) - order.index(phase) in (0, 1)
        phase = after


def test_zeros_spanning_the_reporting_interval_with_no_connection_drain() -> None:
    readings = [Reading(1, 2, connections=1), Reading(2, 0), Reading(2.5, 0), Reading(3, 0, connections=0)]
    _, outcome, index = run(readings)
    assert outcome is Outcome.DRAINED
    assert index == 3


def test_zeros_shorter_than_the_reporting_interval_do_not_drain() -> None:
    # A page that lags the engine (Ray's, every 10 s): the zeros of the first second prove nothing.
    _, outcome, _ = run([Reading(2, 0, connections=0), Reading(2.05, 0, connections=0), Reading(2.9, 0, connections=0)])
    assert outcome is None


def test_one_zero_read_the_reporting_interval_after_the_endpoints_caught_up_drains() -> None:
    # A stream that ends long after the endpoints caught up: the page's first zero shows the engine after the last
    # request could arrive, so no run of zeros is waited for (Ray's page would add its whole lag a second time).
    settled = Drain(started_at=0.0, deadline=100.0, settled_at=1.0)
    readings = [Reading(10, 2, connections=1), Reading(30, 2, connections=1), Reading(30.5, 0, connections=0)]
    drain = settled
    outcomes = []
    for reading in readings:
        drain, outcome = observe(drain, reading, stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
        outcomes.append(outcome)
    assert outcomes == [None, None, Outcome.DRAINED]
    # Sooner than the interval after the endpoints caught up, a zero may be a page not yet showing a late request.
    early, outcome = observe(settled, Reading(1.5, 0, connections=0), stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
    assert outcome is None
    assert next_poll_delay(early, 1.5, poll_interval_s=0.5, zero_confirm_s=CONFIRM_S) == 0.5
    _, outcome = observe(early, Reading(2.0, 0, connections=0), stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
    assert outcome is Outcome.DRAINED
    # And a connection that may still carry a request holds it as before.
    _, outcome = observe(settled, Reading(30, 0, connections=1), stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
    assert outcome is None


def test_a_client_still_connected_holds_a_confirmed_zero_until_it_leaves() -> None:
    readings = [Reading(t / 2, 0, connections=1) for t in range(2, 10)] + [Reading(5, 0, connections=0)]
    _, outcome, index = run(readings)
    assert outcome is Outcome.DRAINED
    assert index == len(readings) - 1
    assert run([Reading(1, 0, connections=None), Reading(2, 0, connections=None)])[1] is None, "unknown is not 0"


def test_a_failed_reading_between_zeros_is_not_a_zero() -> None:
    _, outcome, _ = run([Reading(1, 0, connections=0), Reading(2, None, connections=0), Reading(3, 0, connections=0)])
    assert outcome is None


def test_stall_needs_unchanged_count_still_tokens_and_no_connection() -> None:
    quiet = [Reading(float(t), 3, tokens=50.0, connections=0) for t in range(0, 12)]
    _, outcome, index = run(quiet)
    assert outcome is Outcome.STALLED
    assert quiet[index].at - quiet[1].at >= STALL_S


def test_moving_tokens_or_an_open_connection_is_not_a_stall() -> None:
    moving = [Reading(float(t), 3, tokens=float(t), connections=0) for t in range(0, 30)]
    connected = [Reading(float(t), 3, tokens=5.0, connections=1) for t in range(0, 30)]
    assert run(moving, deadline=1000)[1] is None
    assert run(connected, deadline=1000)[1] is None


def test_a_count_holding_still_without_a_token_counter_is_no_stall() -> None:
    # Ray's page between two exports, or any engine read without a token counter: streams running look like this.
    still = [Reading(float(t), 3, connections=0) for t in range(0, 60)]
    assert run(still, deadline=1000)[1] is None


def test_unknown_connections_never_count_as_quiet() -> None:
    unknown = [Reading(float(t), 3, tokens=5.0, connections=None) for t in range(0, 30)]
    assert run(unknown, deadline=1000)[1] is None


def test_deadline_ends_the_drain_and_counts_the_streams_still_running() -> None:
    drain, outcome, _ = run([Reading(50, 4, tokens=1.0, connections=4), Reading(100, 3, tokens=2.0, connections=3)])
    assert outcome is Outcome.TIMEOUT
    assert streams_cut(drain, outcome) == 3


def test_timeout_after_failed_readings_counts_the_last_good_one() -> None:
    drain, outcome, _ = run([Reading(50, 2, connections=2), Reading(100, None, connections=2)])
    assert outcome is Outcome.TIMEOUT
    assert streams_cut(drain, outcome) == 2


def test_drained_and_stalled_cut_nothing() -> None:
    drain, outcome, _ = run([Reading(1, 0), Reading(2, 0, connections=0)])
    assert outcome is Outcome.DRAINED
    assert streams_cut(drain, outcome) == 0


def test_a_zero_is_read_again_once_its_interval_has_passed_and_no_wait_runs_past_the_deadline() -> None:
    drain = Drain(started_at=0, deadline=10)

    def delay(at: float) -> float:
        return next_poll_delay(drain, at, poll_interval_s=0.5, zero_confirm_s=CONFIRM_S)

    assert delay(0) == 0.5
    drain, _ = observe(drain, Reading(1, 0), stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
    assert delay(1) == 0.5
    drain, _ = observe(drain, Reading(1.5, 0), stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
    assert delay(1.8) == pytest.approx(0.2), "read again as soon as the run of zeros spans the interval"
    assert delay(1.99) == pytest.approx(0.05), "a tenth of a poll interval at the soonest"
    drain, _ = observe(drain, Reading(2, 0, connections=1), stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
    assert delay(2) == 0.5, "a client still connected is looked at once a poll interval"
    instant = Drain(started_at=0, deadline=10)
    instant, _ = observe(instant, Reading(1, 0), stall_after_s=STALL_S, zero_confirm_s=0)
    assert next_poll_delay(instant, 1, poll_interval_s=0.5, zero_confirm_s=0) == 0.05, "no interval: a second read"
    assert next_poll_delay(
        Drain(started_at=0, deadline=10), 9.8, poll_interval_s=0.5, zero_confirm_s=1
    ) == pytest.approx(0.2)
    assert next_poll_delay(Drain(started_at=0, deadline=10), 11, poll_interval_s=0.5, zero_confirm_s=1) == 0


readings = st.builds(
    Reading,
    at=st.just(0.0),
    in_flight=st.one_of(st.none(), st.integers(0, 5)),
    tokens=st.one_of(st.none(), st.sampled_from([0.0, 1.0])),
    connections=st.one_of(st.none(), st.integers(0, 2)),
)


@given(st.lists(readings, min_size=1, max_size=60), st.floats(0.5, 30), st.one_of(st.none(), st.floats(0, 5)))
def test_every_drain_ends_by_its_deadline_and_only_for_a_reason(
    shape: list[Reading], deadline: float, settled_at: float | None
) -> None:
    drain = Drain(started_at=0.0, deadline=deadline, settled_at=settled_at)
    for step, template in enumerate(shape):
        reading = Reading(step * 0.5, template.in_flight, template.tokens, template.connections)
        previous = drain
        drain, outcome = observe(drain, reading, stall_after_s=STALL_S, zero_confirm_s=CONFIRM_S)
        if outcome is Outcome.DRAINED:
            assert reading.in_flight == 0
            assert reading.connections == 0
            run_of_zeros = previous.zero_since is not None and reading.at - previous.zero_since >= CONFIRM_S
            assert run_of_zeros or (settled_at is not None and reading.at - settled_at >= CONFIRM_S)
        if outcome is Outcome.STALLED:
            assert reading.connections == 0
            assert reading.in_flight is not None
        if outcome is not None:
            assert streams_cut(drain, outcome) >= 0
            return
        assert reading.at < deadline
