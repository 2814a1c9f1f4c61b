"""One line of a scenario's verdict: what it checks, whether it held, and what was seen."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def check(name: str, passed: bool, detail: str) -> Check:
    return Check(name, passed, detail)
