"""``spotdrain simulate --compare``: the same node, pods, load and notice played once per way of handling the notice
(``simulate.baselines``), all at once, and what each measured as one row.

The runs are independent (each its own fake API, IMDS, processes and ports) and mostly wait on timers, so they run
side by side in one event loop; the load is the same in each (one seed), the notice comes after the same warm-up.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

from simulate.baselines import WAYS, Way, missing
from simulate.run import RunResult, simulate
from simulate.settings import SimulationSettings
from simulate.summary import Summary
from simulate.timeline import Kind


@dataclass(frozen=True)
class Played:
    way: Way
    result: RunResult | None  # None: skipped
    skipped: str | None = None  # why it could not run here


@dataclass(frozen=True)
class Row:
    """One way's figures: what the table shows."""

    way: str
    started: int
    cut: int
    refused: int
    out_s: float | None  # notice to out of rotation, the slowest pod; None when one stayed in rotation to the deadline
    stayed: int  # pods still in rotation at the deadline
    empty_s: float | None  # how long before the deadline the node was empty; None: it was not
    lost: int  # pods lost with the instance
    prestop_failed: int  # pods whose preStop hook exited non-zero
    prestop_ran: int
    prestop_error: str  # what the first failed hook wrote to stderr


@dataclass(frozen=True)
class Comparison:
    settings: SimulationSettings
    played: tuple[Played, ...]
    wall_s: float  # from the first start to the last run's end

    @property
    def spotdrain(self) -> RunResult | None:
        return next((p.result for p in self.played if p.way.spotdrain), None)

    @property
    def passed(self) -> bool:
        """spotdrain's verdict: the other ways are measured, not judged."""
        return self.spotdrain is not None and self.spotdrain.passed


async def compare(settings: SimulationSettings, *, workdir: Path, ways: tuple[Way, ...] = WAYS) -> Comparison:
    """Play ``settings``' scenario once per way, side by side; a way this machine cannot run is skipped with its
    reason. Raises TimeoutError if a run hangs."""
    ports: set[int] = set()
    started = time.monotonic()

    async def play(way: Way) -> Played:
        if (reason := missing(way)) is not None:
            return Played(way, None, reason)
        (workdir / way.name).mkdir(parents=True, exist_ok=True)
        return Played(way, await simulate(settings, workdir=workdir / way.name, way=way, ports=ports))

    played = await asyncio.gather(*(play(way) for way in ways))
    return Comparison(settings, tuple(played), round(time.monotonic() - started, 1))


def row(played: Played) -> Row | None:
    """The figures of a way that ran; None for one that was skipped."""
    if played.result is None:
        return None
    s = played.result.summary
    hooks = [e for e in played.result.events if e.kind is Kind.PRESTOP_RETURNED]
    failed = [e for e in hooks if e.data.get("code") != 0]
    stayed = _stayed(s)
    return Row(
        way=played.way.name,
        started=s.started,
        cut=s.cut,
        refused=s.refused,
        out_s=s.notice_to_out_max_s if stayed == 0 else None,
        stayed=stayed,
        empty_s=s.spare_s if s.reclaimed == 0 else None,
        lost=s.reclaimed,
        prestop_failed=len(failed),
        prestop_ran=len(hooks),
        prestop_error=str(failed[0].data.get("error", "")) if failed else "",
    )


def _stayed(s: Summary) -> int:
    """Pods that had not left rotation before the deadline (those lost with the instance leave it only then)."""
    deadline = s.deadline_at if s.deadline_at is not None else float("inf")
    return sum(p.out_at is None or p.out_at >= deadline for p in s.pods)
