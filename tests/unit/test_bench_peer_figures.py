"""The gateway-peers figures: added latency is per round against the direct streams of that round, a stream that was
not exact fails the run, and a ratio to peers that could not run is skipped with their reason, never a figure.

Run in a process of their own: importing ``bench`` configures logging for a benchmark's standard output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = """
import json
from dataclasses import asdict
from bench.peer_figures import CONTINUED, LOADS, Run, Target, added, results, table
from bench.peer_routers import Missing
from bench.gateway_streams import LONG, SHORT, _split, split

def target(name, per_round_ms, *, cpu_s=0.1, exact=True):
    runs = [Run([ms] * 100, 1, int(exact), [] if exact else ["event 3"], cpu_s, 1.0) for ms in per_round_ms]
    measured = Target(name, "http://127.0.0.1:1", None if cpu_s is None else 1, 40.0, 45.0, 20.0)
    measured.runs = {load.name: list(runs) for load in LOADS}
    return measured

def continued(name, per_round_ms, *, cpu_s, continued_cpu_s):
    measured = target(name, per_round_ms, cpu_s=cpu_s)
    runs = [Run([ms] * 100, 1, 1, [], continued_cpu_s, 1.0) for ms in per_round_ms]
    measured.runs |= {load.name: list(runs) for load in CONTINUED}
    return measured

def split_target(name, rounds):  # rounds of (CPU, its kernel part) seconds over 100 chunks; None: no split
    measured = target(name, [1.0] * len(rounds))
    runs = [Run([1.0] * 100, 1, 1, [], cpu_s, 1.0, kernel_s=kernel_s) for cpu_s, kernel_s in rounds]
    measured.runs = {load.name: list(runs) for load in LOADS}
    return measured

def named(figures):
    return {figure.name: asdict(figure) for figure in figures}

direct = target("direct", [1.0, 1.0], cpu_s=None)
out = {
    "added": added(target("ours", [1.5, 5.2, 4.0]), target("direct", [1.0, 5.0, 2.0], cpu_s=None), LOADS[0].name, 0.5),
    "not_exact": named(
        results([direct, target("ours", [1.1, 1.1], exact=False)], [], ours="ours", peers=[], floor=None, rounds=2)
    ),
    "missing": named(
        results(
            [direct, target("ours", [1.1, 1.1])],
            [Missing("vllm-router 0.1.17", "pip install failed: no network")],
            ours="ours",
            peers=[],
            floor=None,
            rounds=2,
        )
    ),
    "peers": named(
        results(
            [
                direct,
                target("ours", [3.0, 3.0], cpu_s=0.3),
                target("slow router", [4.0, 4.0], cpu_s=0.4),
                target("fast router", [2.0, 2.0], cpu_s=0.1),
                target("floor", [2.5, 2.5], cpu_s=0.2),
            ],
            [],
            ours="ours",
            peers=["slow router", "fast router"],
            floor="floor",
            rounds=2,
        )
    ),
    "continued": named(
        results(
            [
                continued("direct", [1.0, 1.0], cpu_s=None, continued_cpu_s=None),
                continued("ours", [3.0, 3.0], cpu_s=0.2, continued_cpu_s=0.3),
                continued("router", [2.0, 2.0], cpu_s=0.1, continued_cpu_s=0.2),
            ],
            [],
            ours="ours",
            peers=["router"],
            floor=None,
            rounds=2,
        )
    ),
    "split_table": table(
        [target("direct", [1.0, 1.0], cpu_s=None), split_target("ours", [(0.3, 0.2), (0.5, 0.1), (0.4, 0.3)]),
         split_target("unsplit", [(0.3, None), (0.3, 0.1), (0.3, 0.1)])]
    ),
    "loads": len(LOADS),
    # a stream's start and end, and a chunk, made into the CPU per short and per long stream, and told apart again
    "split": [
        [made, list(split(made[0] + SHORT.chunks * made[1], made[0] + LONG.chunks * made[1]))]
        for made in ([946.0, 34.5], [0.0, 22.0], [666.0, 0.0])
    ],
    # rounds of ((short stream, its kernel part), (long stream, its kernel part)): start and end 946 µs, 300 of it in
    # the kernel; a chunk 34.5 µs, 16 of it; one round off by far, which the medians leave out
    "split_parts": [
        list(_split(rounds, part))
        for rounds in [
            [((946 + 2 * 34.5, 300 + 2 * 16), (946 + 100 * 34.5, 300 + 100 * 16))] * 2
            + [((5000.0, 4000.0), (9000.0, 8000.0))]
        ]
        for part in (0, 1)
    ],
}
print(json.dumps(out))
"""
RATIOS = ("gateway_peers_cpu_per_chunk_ratio_100_streams", "gateway_peers_p99_ratio_100_streams")


@pytest.fixture(scope="module")
def figures() -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", FIGURES], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def test_added_latency_is_the_median_of_each_rounds_difference_to_that_rounds_direct_streams(
    figures: dict[str, Any],
) -> None:
    assert figures["added"] == pytest.approx(0.5)  # differences 0.5, 0.2, 2.0


def test_one_stream_that_was_not_exact_fails_the_run_and_says_which_proxy(figures: dict[str, Any]) -> None:
    exact = figures["not_exact"]["gateway_peers_streams_not_exact"]
    assert exact["passed"] is False
    assert exact["value"] == figures["loads"] * 2  # one stream a run, each load, two rounds: every one of ours
    assert "ours: 0 of" in exact["detail"]


def test_ratios_to_peers_that_could_not_run_are_skipped_with_their_reason(figures: dict[str, Any]) -> None:
    for name in RATIOS:
        skipped = figures["missing"][name]
        assert (skipped["value"], skipped["passed"]) == (None, None)
        assert "no network" in skipped["skipped"]


def test_the_ratios_are_to_the_better_peer(figures: dict[str, Any]) -> None:
    cpu, p99 = (figures["peers"][name] for name in RATIOS)
    assert (cpu["value"], cpu["passed"]) == (3.0, False)
    assert (p99["value"], p99["passed"]) == (1.5, True)
    assert "against fast router" in p99["detail"]


def test_the_python_floor_is_given_beside_the_cpu_ratio_and_never_taken_for_a_peer(figures: dict[str, Any]) -> None:
    cpu = figures["peers"][RATIOS[0]]
    assert "against fast router" in cpu["detail"]
    assert "floor 2.00 times as much" in cpu["detail"]


def test_continued_loads_are_set_beside_the_routers_figures_of_the_same_rounds(figures: dict[str, Any]) -> None:
    """The routers relay whole streams in the continued loads' rounds: the ratio is to what they cost there."""
    cpu = figures["continued"]["gateway_peers_continued_cpu_per_chunk_ratio_500_streams"]
    assert (cpu["value"], cpu["passed"]) == (1.5, False)
    assert "against router's" in cpu["detail"]
    p50 = figures["continued"]["gateway_peers_continued_p50_added_500_streams_over_router"]
    assert (p50["value"], p50["passed"]) == (1.0, False)  # 2.0 ms added against the router's 1.0
    plain = figures["continued"]["gateway_peers_cpu_per_chunk_ratio_500_streams"]
    assert (plain["value"], plain["passed"]) == (2.0, False)


def test_a_streams_start_and_end_is_told_from_its_chunks_by_a_short_and_a_long_load(figures: dict[str, Any]) -> None:
    for made, told in figures["split"]:
        assert told == pytest.approx(made)
    whole, kernel = figures["split_parts"]
    assert whole == pytest.approx([946.0, 34.5])
    assert kernel == pytest.approx([300.0, 16.0])


def test_the_cpu_per_chunk_is_told_into_the_kernels_part_and_the_rest_each_a_median_of_rounds(
    figures: dict[str, Any],
) -> None:
    rows = figures["split_table"].split("\n")
    at = next(i for i, row in enumerate(rows) if "in the kernel" in row)
    split = rows[at + 2 :]
    # per chunk: kernel 2000, 1000, 3000 µs (median 2000); the rest 1000, 4000, 1000 (median 1000)
    assert split[0] == "| ours | 2000.0 / 2000.0 µs | 1000.0 / 1000.0 µs |"
    assert split[1] == "| unsplit | — | — |"
    assert not any(row.startswith("| direct ") for row in split)
