"""The README and docs/ hold together: every relative link reaches a file and every anchor a heading, and every
``spotdrain ...`` they show is a command line the CLI accepts (parsed with the real argument parser)."""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

import pytest

from spotdrain.cli import COMMANDS, build_parser
from tests.unit.docs_pages import ROOT, Command, anchors, commands, pages, relative_links, slug

# What a page may call by name alone, in inline code: `spotdrain inject`, `spotdrain cache fetch`.
PROGRAM_NAMES = [[name] for name in COMMANDS] + [["cache", "fetch"], ["cache", "prefetch"]]


def test_the_readme_is_a_landing_page_and_the_docs_are_where_it_links() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    linked = {link.resolve()[0] for link in relative_links(ROOT / "README.md")}
    assert sorted(p.name for p in pages()[1:] if p not in linked) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_every_anchor_a_heading(page: Path) -> None:
    broken = []
    for link in relative_links(page):
        path, anchor = link.resolve()
        if not path.exists():
            broken.append(f"{link.line}: {link.target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            broken.append(f"{link.line}: {link.target}: no heading #{anchor} in {path.name}")
    assert broken == []


def _error(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """What the parser says of ``words``, or None when it accepts them."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(words)
    except SystemExit as exit_:
        return errors.getvalue().strip().splitlines()[-1] if exit_.code else None
    return None


def _completed(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """An inline mention (`spotdrain inject --readiness-gate`) with the options it leaves out and the command
    requires given a value, so that what it does show is still checked."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = subparsers.choices[words[0]]
    missing = [
        a for a in command._actions if a.required and a.option_strings and not set(a.option_strings) & set(words)
    ]
    return words + [word for action in missing for word in (action.option_strings[0], "x")]


def test_every_command_line_in_the_docs_is_one_the_cli_accepts() -> None:
    parser = build_parser()
    found: list[Command] = [command for page in pages() for command in commands(page)]
    assert len(found) > 40
    rejected = []
    for command in found:
        inline = not command.fenced
        if not command.words or (inline and command.words in PROGRAM_NAMES):
            continue  # the project's name, or a program's
        words = _completed(parser, command.words) if inline and command.words[0] in COMMANDS else command.words
        if (error := _error(parser, words)) is not None:
            rejected.append(f"{command}: {error}")
    assert rejected == []


def test_a_misspelt_flag_or_a_bad_value_is_rejected() -> None:
    parser = build_parser()
    assert _error(parser, ["check", "--output", "yaml"]) is not None
    assert _error(parser, ["check", "--nodes", "a"]) is not None
    assert _error(parser, _completed(parser, ["inject", "--readiness-gate"])) is None


def test_anchors_are_githubs() -> None:
    assert slug("`spotdrain check`: what is wrong with an install") == "spotdrain-check-what-is-wrong-with-an-install"
    assert slug("Compared with what users run today (`--compare`)") == "compared-with-what-users-run-today---compare"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_a_broken_link_and_a_missing_anchor_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Part two\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#part-two) [gone](missing.md) [no anchor](other.md#part-three) [self](#page)\n"
        "`[not a link](nowhere.md)` [web](https://example.com/x.md)\n```\n[in code](nowhere.md)\n```\n"
    )
    targets = [link.target for link in relative_links(page)]
    assert targets == ["other.md#part-two", "missing.md", "other.md#part-three", "#page"]
    resolved = [link.resolve() for link in relative_links(page)]
    assert [path.exists() for path, _ in resolved] == [True, False, True, True]
    assert "part-three" not in anchors((tmp_path / "other.md").read_text())
    assert "page" in anchors(page.read_text())


def test_command_lines_are_split_as_a_shell_splits_them(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `spotdrain check --namespace ml` or\n```sh\n$ spotdrain check \\\n  --output json | jq .  # for CI\n"
        "spotdrain inject -f app.yaml > out.yaml\n```\n"
    )
    assert [(c.words, c.fenced) for c in commands(page)] == [
        (["check", "--namespace", "ml"], False),
        (["check", "--output", "json"], True),
        (["inject", "-f", "app.yaml"], True),
    ]
