"""What a fault campaign draws and what it counts, as pure data: no I/O.

The faults (``simulate.campaign`` says what each does), a ``Plan`` per run, the ``Outcome`` its checks found, and the
``Tally`` of them all with its JSON ``report``.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

API_FAULTS = ("hang", "drop", "garbage", "server-error", "conflict", "throttled")
IMDS_FAULTS = ("imds-outage", "imds-token")
KINDS = (*API_FAULTS, *IMDS_FAULTS, "agent-restart")


@dataclass(frozen=True)
class Plan:
    number: int
    fault: str
    queue: bool
    point: int  # API requests let through before the fault
    applied: bool
    status: int
    count: int
    variant: int

    @classmethod
    def draw(cls, number: int, rng: random.Random, *, queue: bool) -> Plan:
        # Queue mode reads no IMDS, and a killed queue-mode agent's message comes back only after its visibility
        # timeout (30 s at least): those faults are drawn in IMDS mode.
        fault = rng.choice(API_FAULTS if queue else KINDS)
        status = {"conflict": 409, "throttled": 429}.get(fault, rng.choice((500, 502, 503, 504)))
        count = rng.randint(1, 3) if fault == "server-error" else rng.randint(2, 8) if fault in IMDS_FAULTS else 1
        return cls(number, fault, queue, rng.randint(0, 7), rng.random() < 0.5, status, count, rng.randint(0, 1))


@dataclass
class Outcome:
    plan: Plan
    struck: bool  # the fault happened (a point after the run's last request never comes)
    problems: list[str]
    lost: bool
    wrong_node: bool
    seconds: float  # from the notice to the run's end


@dataclass
class Tally:
    runs: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    struck: Counter[str] = field(default_factory=Counter)
    queue_runs: int = 0
    lost: int = 0
    wrong_nodes: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, outcome: Outcome) -> None:
        self.runs += 1
        self.run_seconds.setdefault(outcome.plan.fault, []).append(outcome.seconds)
        self.faults[outcome.plan.fault] += 1
        self.struck[outcome.plan.fault] += outcome.struck
        self.queue_runs += outcome.plan.queue
        self.lost += outcome.lost
        self.wrong_nodes += outcome.wrong_node
        self.problems += [f"run {outcome.plan.number} ({outcome.plan}): {p}" for p in outcome.problems]

    def summary(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "queue_mode_runs": self.queue_runs,
            "faults": dict(sorted(self.faults.items())),
            "faults_struck": dict(sorted(self.struck.items())),
            "notices_lost": self.lost,
            "wrong_nodes": self.wrong_nodes,
            "problems": len(self.problems),
            "seconds": round(self.seconds, 1),
            "mean_run_seconds": {kind: round(sum(s) / len(s), 2) for kind, s in sorted(self.run_seconds.items())},
        }


def report(tally: Tally) -> str:
    return json.dumps(tally.summary(), indent=2)
