"""``spotdrain simulate``: the command line. Only the flags load with the ``spotdrain`` command; the simulation and
its fakes are imported when it runs, so no other subcommand pays for them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import structlog

from simulate.settings import SimulationSettings, from_arguments
from simulate.settings import add_arguments as add_arguments


@contextlib.contextmanager
def _workdir(kept: Path | None) -> Iterator[Path]:
    if kept is not None:
        kept.mkdir(parents=True, exist_ok=True)
        yield kept
        return
    with tempfile.TemporaryDirectory(prefix="spotdrain-simulate-") as temporary:
        yield Path(temporary)


@contextlib.contextmanager
def _logging_to(handle: TextIO) -> Iterator[None]:
    # The fakes in this process log as the programs do; on the terminal only the timeline should show.
    before = structlog.get_config()["logger_factory"]
    structlog.configure(logger_factory=structlog.WriteLoggerFactory(file=handle))
    try:
        yield
    finally:
        structlog.configure(logger_factory=before)


def _vllm_missing() -> str | None:
    """Why real vLLM cannot serve the pods here (None: it can)."""
    from simulate.vllm.server import available

    reason = available()
    return None if reason is None else f"{reason}; `python -m simulate.vllm install` installs it"


def _say(line: str) -> None:
    print(line, flush=True)


def main(args: argparse.Namespace) -> int:
    settings = from_arguments(args)
    if settings.compare:
        return _compare(settings)
    if settings.engine == "vllm" and (reason := _vllm_missing()) is not None:
        print(f"spotdrain simulate --engine vllm: skipped: {reason}", file=sys.stderr)
        return 0
    from simulate.page import render_html
    from simulate.report import as_json, header, live_printer, verdict
    from simulate.run import budget_s, simulate
    from simulate.scenarios import SCENARIOS

    with (
        _workdir(settings.log_dir) as workdir,
        (workdir / "simulation.log").open("a") as own_log,
        _logging_to(own_log),
    ):
        if not settings.json:
            _say(header(settings, SCENARIOS[settings.scenario]))
        sink = None if settings.json else live_printer(_say)
        try:
            result = asyncio.run(simulate(settings, workdir=workdir, sink=sink))
        except TimeoutError:
            print(_hung(settings, budget_s(settings)), file=sys.stderr)
            return 1
        if settings.json:
            json.dump(as_json(result), sys.stdout, indent=2)
            _say("")
        else:
            _say("\n" + verdict(result))
        if settings.html is not None:
            settings.html.write_text(render_html(result))
            print(f"timeline drawn in {settings.html}", file=sys.stderr)
    return 0 if result.passed else 1


def _compare(settings: SimulationSettings) -> int:
    """Every way side by side: the table (or JSON), and the page; exits as spotdrain's verdict says."""
    from simulate.compare import compare
    from simulate.compare_report import as_json, header, render, render_html
    from simulate.run import budget_s

    with (
        _workdir(settings.log_dir) as workdir,
        (workdir / "simulation.log").open("a") as own_log,
        _logging_to(own_log),
    ):
        if not settings.json:
            _say(header(settings) + "\n")
        try:
            comparison = asyncio.run(compare(settings, workdir=workdir))
        except TimeoutError:
            print(_hung(settings, budget_s(settings)), file=sys.stderr)
            return 1
        if settings.json:
            json.dump(as_json(comparison), sys.stdout, indent=2)
            _say("")
        else:
            _say(render(comparison))
        if settings.html is not None:
            settings.html.write_text(render_html(comparison))
            print(f"comparison drawn in {settings.html}", file=sys.stderr)
    return 0 if comparison.passed else 1


def _hung(settings: SimulationSettings, budget: float) -> str:
    where = f"see the logs in {settings.log_dir}" if settings.log_dir else "run again with --log-dir DIR to keep logs"
    return f"spotdrain simulate: the run did not end within {budget:.0f} s and was stopped; {where}"
