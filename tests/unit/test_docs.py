"""The README and docs/ are the reference users read: every flag and every metric series the code has must be in
them."""

from __future__ import annotations

import argparse

import pytest

from tests.conftest import every_series
from tests.deploy.manifests import option_strings
from tests.unit.docs_pages import text_of_docs

README = text_of_docs()  # README.md and every page of docs/


def series() -> list[str]:
    return [m.name + ("_total" if m.type == "counter" else "") for m in every_series().collect()]


def test_every_series_starts_with_spotdrain_and_is_documented() -> None:
    names = series()
    assert len(names) >= 20
    for name in names:
        assert name.startswith("spotdrain_"), name
        assert f"`{name}" in README, f"{name} is not documented in README.md or docs/"


@pytest.mark.parametrize("command", ["sidecar", "node", "cache", "inject", "webhook", "simulate", "gateway", "check"])
def test_every_flag_is_documented(command: str) -> None:
    # A switch's negation (--no-evict for --evict) is documented once for all switches.
    flags = [flag for flag in option_strings(command) if flag.startswith("--")]
    documented = [flag.replace("--no-", "--", 1) if flag.startswith("--no-") else flag for flag in flags]
    missing = [flag for flag in documented if flag != "--help" and flag not in README]
    assert missing == [], f"spotdrain {command}: {missing} not in README.md or docs/"


def test_every_cache_fetch_flag_is_documented() -> None:
    from agent.cache.fetch.settings import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings if option.startswith("--")}
    documented = {flag.replace("--no-", "--", 1) for flag in flags} - {"--help"}
    assert sorted(flag for flag in documented if f"`{flag}`" not in README) == []
