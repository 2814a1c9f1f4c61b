"""One line of a scenario's verdict: what it checks, whether it held, and what was seen."""

from __future__ import annotations

from dataclasses import dataclass

from simulate.summary import Summary


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def check(name: str, passed: bool, detail: str) -> Check:
    return Check(name, passed, detail)


def all_gone(s: Summary) -> Check:
    left = [p.name for p in s.pods if p.gone_at is None]
    return check("every pod gone", not left, f"left: {', '.join(left)}" if left else "all pods left the node")
