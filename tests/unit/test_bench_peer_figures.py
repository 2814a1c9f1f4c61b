"""The gateway-peers figures: added latency is per round against the direct streams of that round, a stream that was
not exact fails the run, and a ratio to peers that could not run is skipped with their reason, never a figure."""

from __future__ import annotations

from bench.common import Result
from bench.peer_figures import LOADS, Run, Target, added, results
from bench.peer_routers import Missing

ROUNDS = 2


def run(ms: float, *, cpu_s: float | None = 0.1, exact: bool = True, load_average: float = 1.0) -> Run:
    """A run whose every chunk took ``ms``, 100 chunks of one stream."""
    return Run([ms] * 100, 1, int(exact), [] if exact else ["event 3: b'...'"], cpu_s, load_average)


def target(name: str, per_round_ms: list[float], *, cpu_s: float | None = 0.1, exact: bool = True) -> Target:
    measured = Target(name, "http://127.0.0.1:1/v1/completions", None if cpu_s is None else 1, 40.0, 45.0, 20.0)
    measured.runs = {load.name: [run(ms, cpu_s=cpu_s, exact=exact) for ms in per_round_ms] for load in LOADS}
    return measured


def by_name(figures: list[Result]) -> dict[str, Result]:
    return {figure.name: figure for figure in figures}


def test_added_latency_is_the_median_of_each_rounds_difference_to_that_rounds_direct_streams() -> None:
    direct = target("direct", [1.0, 5.0, 2.0], cpu_s=None)
    ours = target("ours", [1.5, 5.2, 4.0])
    assert added(ours, direct, LOADS[0].name, 0.5) == 0.5  # differences 0.5, 0.2, 2.0


def test_one_stream_that_was_not_exact_fails_the_run_and_says_which_proxy() -> None:
    targets = [target("direct", [1.0, 1.0], cpu_s=None), target("ours", [1.1, 1.1], exact=False)]
    figures = by_name(results(targets, [], ours="ours", peers=[], rounds=ROUNDS))
    exact = figures["gateway_peers_streams_not_exact"]
    assert exact.passed is False
    assert exact.value == len(LOADS) * ROUNDS  # one stream per run, every one of ours
    assert "ours: 0 of" in exact.detail


def test_ratios_to_peers_that_could_not_run_are_skipped_with_their_reason() -> None:
    targets = [target("direct", [1.0, 1.0], cpu_s=None), target("ours", [1.1, 1.1])]
    missing = [Missing("vllm-router 0.1.17", "pip install failed: no network")]
    figures = by_name(results(targets, missing, ours="ours", peers=[], rounds=ROUNDS))
    for name in ("gateway_peers_cpu_per_chunk_ratio_100_streams", "gateway_peers_p99_ratio_100_streams"):
        assert figures[name].value is None
        assert figures[name].passed is None
        assert "no network" in (figures[name].skipped or "")


def test_the_ratios_are_to_the_better_peer() -> None:
    targets = [
        target("direct", [1.0, 1.0], cpu_s=None),
        target("ours", [3.0, 3.0], cpu_s=0.3),
        target("slow router", [4.0, 4.0], cpu_s=0.4),
        target("fast router", [2.0, 2.0], cpu_s=0.1),
    ]
    figures = by_name(results(targets, [], ours="ours", peers=["slow router", "fast router"], rounds=ROUNDS))
    cpu = figures["gateway_peers_cpu_per_chunk_ratio_100_streams"]
    p99 = figures["gateway_peers_p99_ratio_100_streams"]
    assert (cpu.value, cpu.passed) == (3.0, False)
    assert (p99.value, p99.passed) == (1.5, True)
    assert "against fast router" in p99.detail
