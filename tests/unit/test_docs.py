"""The README is the reference users read: every flag and every metric series the code has must be in it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from agent.cli import build_parser
from agent.metrics import CollectorRegistry
from daemonset.cache_main import CacheMetrics
from daemonset.imds import ImdsMetrics
from daemonset.metrics import AgentMetrics
from daemonset.sqs import SqsMetrics
from sidecar.metrics import SidecarMetrics

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def series() -> list[str]:
    registry = CollectorRegistry()
    SidecarMetrics.create(registry)
    AgentMetrics.create(registry)
    ImdsMetrics(registry)
    SqsMetrics.create(registry)
    CacheMetrics.create(registry)
    return [m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()]


def flags(command: str) -> list[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subparsers.choices[command]
    return [option for action in parser._actions for option in action.option_strings if option.startswith("--")]


def test_every_series_starts_with_spotdrain_and_is_documented() -> None:
    names = series()
    assert len(names) >= 20
    for name in names:
        assert name.startswith("spotdrain_"), name
        assert f"`{name}" in README, f"{name} is not documented in README.md"


@pytest.mark.parametrize("command", ["sidecar", "node", "cache", "inject"])
def test_every_flag_is_documented(command: str) -> None:
    # A switch's negation (--no-evict for --evict) is documented once for all switches.
    documented = [flag.replace("--no-", "--", 1) if flag.startswith("--no-") else flag for flag in flags(command)]
    missing = [flag for flag in documented if flag != "--help" and flag not in README]
    assert missing == [], f"spotdrain {command}: {missing} not in README.md"
