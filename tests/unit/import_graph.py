"""The project's import graph, read from the source with ast: which module imports which, lazy imports included.

What may import what is written down in ``ALLOWED``; ``violations`` and ``cycles`` are pure functions of a graph, so
their tests can hand them a graph that breaks every rule.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Every top-level package of the repository, found rather than listed, so that a new program is checked too.
PACKAGES = tuple(sorted(path.parent.name for path in ROOT.glob("*/__init__.py")))
PROGRAMS = tuple(name for name in PACKAGES if name not in ("bench", "tests"))

# Importer prefix -> the prefixes it may import (the longest matching importer prefix applies); None: anything.
# sidecar/ runs in every inference pod and must not carry the node agent; the notice sources know nothing of what is
# done about a notice; the fakes never borrow the code they stand in front of; only the tests, the benchmarks and
# `spotdrain simulate` itself use simulate/.
ALLOWED: dict[str, tuple[str, ...] | None] = {
    "spotdrain": ("spotdrain",),
    "sidecar": ("spotdrain", "sidecar"),
    "agent": ("spotdrain", "agent", "check"),  # the agent runs spotdrain check's checks on a timer
    "agent.notices": ("spotdrain", "agent.notices"),
    "agent.drain": ("spotdrain", "agent.notices", "agent.drain"),
    "agent.cache": ("spotdrain", "agent.cache", "agent.drain.nodes"),  # the cache marks its node as the drain does
    "inject": ("spotdrain", "inject"),
    # `spotdrain check` finds the API as the agent does; the agent exports the same findings.
    # --node plans the drain with the agent's own pure planning.
    "check": ("spotdrain", "check", "agent.drain.kube_config", "agent.drain.planning"),
    "webhook": ("spotdrain", "inject", "webhook"),  # the second front end of inject.pods
    "simulate": ("spotdrain", "simulate"),
    # The fault campaign runs the node agent in its own process, where the simulation starts it as a program.
    "simulate.campaign": ("spotdrain", "simulate", "agent"),
    "gateway": ("spotdrain", "gateway"),  # the stream-continuation gateway, a program of its own
    "bench": None,
    "tests": None,
}

Graph = Mapping[str, set[str]]


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of the given top-level packages under ``root``, by dotted name."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            found[module_name(path, root)] = path
    return found


def _within(name: str, known: Iterable[str]) -> str | None:
    """The longest known module that ``name`` is or lies in (``agent.drain.handler.X`` -> ``agent.drain.handler``)."""
    matches = [m for m in known if name == m or name.startswith(f"{m}.")]
    return max(matches, key=len) if matches else None


def imports_of(tree: ast.AST, module: str, *, is_package: bool, known: set[str]) -> set[str]:
    """The known modules a module's source imports, anywhere in it (inside functions and TYPE_CHECKING too)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        found |= {target for target in (_within(name, known) for name in names) if target is not None}
    return found - {module}


def graph(root: Path = ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    files = sources(root, packages)
    known = set(files)
    return {
        name: imports_of(ast.parse(path.read_text(), str(path)), name, is_package=path.stem == "__init__", known=known)
        for name, path in files.items()
    }


def _rule(importer: str) -> tuple[str, ...] | None:
    prefix = _within(importer, ALLOWED)
    return ALLOWED[prefix] if prefix is not None else ()


def violations(edges: Graph) -> list[tuple[str, str]]:
    """Every (importer, imported) pair that ``ALLOWED`` forbids."""
    bad = []
    for importer, imported in sorted(edges.items()):
        allowed = _rule(importer)
        if allowed is None:
            continue
        bad += [(importer, target) for target in sorted(imported) if _within(target, allowed) is None]
    return bad


def cycles(edges: Graph) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def closure(edges: Graph, start: Iterable[str]) -> set[str]:
    """Every module that importing ``start`` can load, lazily or not."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += edges.get(module, ())
    return seen


def copied_packages(dockerfile: str) -> set[str]:
    """The project's folders a Dockerfile copies into its image (``COPY agent ./agent``)."""
    return set(re.findall(r"^COPY (\w+) \./\1$", (ROOT / dockerfile).read_text(), re.MULTILINE))
