"""README.md and docs/ read as GitHub renders them: the headings' anchors, the relative links, and the ``spotdrain``
command lines they show (in code blocks and in inline code), split as a shell would split them."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def text_of_docs() -> str:
    """Every page, one after the other: what a flag or a series must be documented in."""
    return "\n".join(page.read_text() for page in pages())


def prose_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, line, inside a code block)."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        yield number, line, fenced


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor; a repeated one gets ``-1``, ``-2``... as GitHub numbers them."""
    found: set[str] = set()
    for _, line, fenced in prose_lines(text):
        heading = re.match(r"^#{1,6} (.*)$", line)
        if heading and not fenced:
            base = slug(heading.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_CODE = re.compile(r"`[^`]*`")


@dataclass(frozen=True)
class Link:
    page: Path
    line: int
    target: str

    def resolve(self) -> tuple[Path, str]:
        path, _, anchor = self.target.partition("#")
        return (self.page.parent / path).resolve() if path else self.page, anchor


def relative_links(page: Path) -> list[Link]:
    """Links to a file or an anchor of this repository (not ``http(s):``, ``mailto:``)."""
    found = []
    for number, line, fenced in prose_lines(page.read_text()):
        if fenced:
            continue
        for target in _LINK.findall(_CODE.sub("", line)):
            if not re.match(r"^[a-z]+:", target):
                found.append(Link(page, number, target))
    return found


@dataclass(frozen=True)
class Command:
    page: Path
    line: int
    words: list[str]
    fenced: bool  # a line of a code block (else inline code)

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}: {shlex.join(self.words)}"


_SHELL_ENDS = {"|", "||", "&&", ";", ">", ">>", "2>", "2>&1", "&"}


def _words(command: str) -> list[str]:
    """The words of the first command of a shell line: up to a pipe, ``&&``, a redirection or a comment."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = []
    for word in lexer:
        if word in _SHELL_ENDS:
            break
        words.append(word)
    return words


def commands(page: Path) -> list[Command]:
    """Every ``spotdrain ...`` command line: a line of a code block, or an inline code span, that starts with it.
    A code line ending in ``\\`` goes on on the next."""
    found: list[Command] = []
    pending = ""
    for number, line, fenced in prose_lines(page.read_text()):
        if fenced:
            line = pending + line.strip().removeprefix("$ ")
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            pending = ""
            spans = [line]
        else:
            spans = [span.strip("`") for span in _CODE.findall(line)]
        for span in spans:
            if re.match(r"^spotdrain(\s|$)", span):
                found.append(Command(page, number, _words(span)[1:], fenced))
    return found
