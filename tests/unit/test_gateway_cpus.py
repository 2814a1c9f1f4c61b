"""The gateway's default worker count is the CPUs its container may use: the cgroup quota, not the node's CPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.cpus import cpu_quota, default_workers, workers_for
from gateway.settings import from_arguments
from spotdrain.cli import build_parser


@pytest.mark.parametrize(
    ("cpu_max", "cpus"),
    [
        ("max 100000\n", None),  # no limit
        ("200000 100000\n", 2.0),  # limits.cpu: 2
        ("150000 100000", 1.5),
        ("50000 100000", 0.5),  # limits.cpu: 500m
        ("-1 100000", None),  # cgroup v1's "no quota", as the v1 files read together
        ("", None),
        ("lots 100000", None),
        ("100000 0", None),
    ],
)
def test_cpu_quota_reads_cgroup_cpu_max(cpu_max: str, cpus: float | None) -> None:
    assert cpu_quota(cpu_max) == cpus


@pytest.mark.parametrize(
    ("quota", "cpus", "workers"),
    [(None, 4, 4), (2.0, 64, 2), (1.5, 64, 2), (0.5, 64, 1), (8.0, 2, 2), (None, 0, 1)],
)
def test_one_worker_per_cpu_the_quota_allows_rounded_up_and_no_more_than_the_cpus_it_may_run_on(
    quota: float | None, cpus: int, workers: int
) -> None:
    assert workers_for(quota, cpus) == workers


def test_default_workers_reads_cgroup_v2_then_v1_and_else_takes_the_cpus_it_may_run_on(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert default_workers(tmp_path) == cpus  # no cgroup files: no quota
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert default_workers(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(cpus + 5) * 100000} 100000\n")
    assert default_workers(tmp_path) == cpus


def test_workers_come_from_the_flag_or_the_variable_and_default_to_the_containers_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = ["gateway", "--backend", "http://a:8000"]
    assert from_arguments(build_parser().parse_args(base)).workers == default_workers()
    assert from_arguments(build_parser().parse_args([*base, "--workers", "3"])).workers == 3
    monkeypatch.setenv("SPOTDRAIN_WORKERS", "5")
    assert from_arguments(build_parser().parse_args(base)).workers == 5
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--workers", "0"])
