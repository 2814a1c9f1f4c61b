"""A comparison as people read it: one table (Markdown, so it reads on a terminal and pastes into a document), what
each way is, and notes; or the same as JSON; or a page with the table and each way's timeline."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

from simulate.compare import Comparison, Played, Row, row
from simulate.page import LEGEND, STYLE, timeline_svg
from simulate.report import as_json as run_json
from simulate.report import verdict
from simulate.scenarios import SCENARIOS
from simulate.settings import SimulationSettings
from spotdrain.settings import plain

COLUMNS = (
    "way",
    "streams started",
    "streams cut",
    "new requests refused",
    "notice to out of rotation (slowest pod)",
    "node empty before the deadline",
)
REENACTED = "every way but spotdrain is a re-enactment of documented behaviour, not the other project's code"


def header(s: SimulationSettings) -> str:
    return (
        f"spotdrain simulate --compare: {s.scenario}, {s.pods} pods x {s.streams_per_pod} streams at "
        f"{s.tokens_per_s:g} tokens/s, seed {s.seed}; a notice of {s.timings.notice_s:g} s stands for the 120 s "
        "of a Spot warning"
    )


def _out(r: Row) -> str:
    if r.stayed:
        return f"not before the deadline ({_pods(r.stayed)})"
    return "-" if r.out_s is None else f"{r.out_s:.2f} s"


def _empty(r: Row) -> str:
    if r.empty_s is not None:
        return f"{r.empty_s:.1f} s"
    return f"not empty: {_pods(r.lost)} lost" if r.lost else "not empty"


def cells(played: Played) -> list[str]:
    r = row(played)
    if r is None:
        return [played.way.name, *["skipped"] * (len(COLUMNS) - 2), f"skipped: {played.skipped}"]
    return [r.way, str(r.started), str(r.cut), str(r.refused), _out(r), _empty(r)]


def table(c: Comparison) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    lines += ["| " + " | ".join(cells(p)) + " |" for p in c.played]
    return "\n".join(lines)


def notes(c: Comparison) -> list[str]:
    """What the table cannot say: how the hooks ended, and which ways were skipped."""
    out = []
    for played in c.played:
        r = row(played)
        if r is None:
            out.append(f"{played.way.name}: skipped, {played.skipped}")
        elif r.prestop_failed:
            said = f" ({r.prestop_error})" if r.prestop_error else ""
            out.append(
                f"{r.way}: the preStop hook failed on {r.prestop_failed} of {r.prestop_ran} pods{said}; "
                "the kubelet sent SIGTERM all the same"
            )
    return out


def render(c: Comparison) -> str:
    """The table with its legend, the notes, the wall time and spotdrain's verdict."""
    lines = [table(c), "", f"ways ({REENACTED}):"]
    lines += [f"  {p.way.name:<20}{p.way.title}" for p in c.played]
    lines += [f"  note: {note}" for note in notes(c)]
    lines.append(f"  played side by side in {c.wall_s:.1f} s of wall time")
    if c.spotdrain is not None:
        lines += ["", verdict(c.spotdrain)]
    return "\n".join(lines)


def as_json(c: Comparison) -> dict[str, Any]:
    return {
        "compare": True,
        "scenario": c.settings.scenario,
        "settings": plain(c.settings),
        "passed": c.passed,
        "wall_s": c.wall_s,
        "ways": [
            {
                "way": p.way.name,
                "title": p.way.title,
                "skipped": p.skipped,
                "row": None if (r := row(p)) is None else dataclasses.asdict(r),
                "run": None if p.result is None else run_json(p.result),
            }
            for p in c.played
        ],
    }


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def render_html(c: Comparison) -> str:
    """The table, then each way's timeline as ``--html`` draws a run."""
    head = "".join(f"<th>{_e(name)}</th>" for name in COLUMNS)
    rows = "".join("<tr>" + "".join(f"<td>{_e(cell)}</td>" for cell in cells(p)) + "</tr>" for p in c.played)
    ways = "".join(f"<li><b>{_e(p.way.name)}</b>: {_e(p.way.title)}</li>" for p in c.played)
    sections = [
        f'<section class="way" data-way="{_e(p.way.name)}"><h2>{_e(p.way.name)}</h2>'
        f"<p>{_e(p.way.title)}</p>{timeline_svg(p.result)}</section>"
        for p in c.played
        if p.result is not None
    ]
    spotdrain = c.spotdrain
    judged = "" if spotdrain is None else f"<h2>Verdict (spotdrain)</h2><pre>{_e(verdict(spotdrain))}</pre>"
    title = f"spotdrain simulate --compare: {c.settings.scenario}"
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title><style>{STYLE}'
        "table.compare td, table.compare th { padding: .2em .8em; border-bottom: 1px solid #dadce0; }</style>"
        f"</head><body><h1>{_e(title)}</h1><p>{_e(header(c.settings))}. {_e(SCENARIOS[c.settings.scenario].title)}.</p>"
        f'<section class="comparison"><h2>Compared</h2><table class="compare"><tr>{head}</tr>{rows}</table>'
        f"<p>{_e(REENACTED.capitalize())}.</p><ul>{ways}</ul>"
        + "".join(f"<p>{_e(note)}</p>" for note in notes(c))
        + f"<p>Played side by side in {c.wall_s:.1f} s of wall time.</p></section>"
        f'<p class="legend">{LEGEND}</p>{"".join(sections)}{judged}'
        "</body></html>\n"
    )


def _pods(count: int) -> str:
    return f"{count} pod" if count == 1 else f"{count} pods"
