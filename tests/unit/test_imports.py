"""The folders' import directions hold and no module takes part in an import cycle, read from the source with ast."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.unit import import_graph
from tests.unit.import_graph import (
    ALLOWED,
    PACKAGES,
    closure,
    copied_packages,
    cycles,
    imports_of,
    violations,
)

SIDECAR = ("spotdrain.cli", "sidecar.settings", "sidecar.main")
AGENT = (
    "spotdrain.cli",
    "agent.node_settings",
    "agent.main",
    "agent.cache.settings",
    "agent.cache.main",
    "agent.cache.run",
    "check.settings",
    "check.main",
)
WEBHOOK = ("spotdrain.cli", "webhook.settings", "webhook.server")


@functools.cache
def graph() -> dict[str, set[str]]:
    """The repository's graph, read once per run."""
    return import_graph.graph()


def test_no_module_imports_against_the_direction_of_the_folders() -> None:
    assert violations(graph()) == []


def test_no_module_is_part_of_an_import_cycle() -> None:
    assert cycles(graph()) == []


def test_every_top_level_package_says_what_it_may_import() -> None:
    assert [name for name in PACKAGES if name not in ALLOWED] == []


def test_the_graph_sees_every_program_and_its_imports() -> None:
    edges = graph()
    assert {name.partition(".")[0] for name in edges} >= {
        "spotdrain",
        "agent",
        "sidecar",
        "inject",
        "webhook",
        "simulate",
    }
    assert "webhook.selfmanaged" in edges["webhook.server"]  # imported only in self-managed mode, still an edge
    assert "spotdrain.retry" in edges["agent.drain.handler"]
    assert "inject.manifest" in edges["inject.cli"]  # imported inside main(), still an edge


@pytest.mark.parametrize(
    ("dockerfile", "entry"),
    [("Dockerfile.sidecar", SIDECAR), ("Dockerfile.agent", AGENT), ("Dockerfile.webhook", WEBHOOK)],
)
def test_each_image_copies_exactly_the_folders_its_program_loads(dockerfile: str, entry: tuple[str, ...]) -> None:
    assert {name.partition(".")[0] for name in closure(graph(), entry)} == copied_packages(dockerfile)


def test_forbidden_directions_are_reported() -> None:
    edges = {
        "sidecar.main": {"spotdrain.tasks", "agent.drain.nodes"},
        "agent.drain.handler": {"agent.notices.notice", "simulate.fakes.kube"},
        "agent.notices.sqs": {"agent.drain.board"},
        "spotdrain.cli": {"sidecar.main"},
        "inject.pods": {"sidecar.settings"},
        "simulate.cluster": {"agent.main"},
        "tests.unit.test_x": {"simulate.fakes.kube", "agent.main"},
        "bench.node": {"simulate.fakes.imds"},
    }
    assert violations(edges) == [
        ("agent.drain.handler", "simulate.fakes.kube"),
        ("agent.notices.sqs", "agent.drain.board"),
        ("inject.pods", "sidecar.settings"),
        ("sidecar.main", "agent.drain.nodes"),
        ("simulate.cluster", "agent.main"),
        ("spotdrain.cli", "sidecar.main"),
    ]


def test_a_cycle_through_several_modules_is_reported_once() -> None:
    edges = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x", "b.q"}, "b.q": set(), "c.r": {"c.s"}, "c.s": {"c.r"}}
    assert cycles(edges) == [["a.x", "a.y", "a.z"], ["c.r", "c.s"]]
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_a_lazy_relative_import_inside_a_function_is_an_edge(tmp_path: Path) -> None:
    source = "def main():\n    from . import manifest\n    from .pods import Options\n"
    known = {"inject.cli", "inject.manifest", "inject.pods"}
    assert imports_of(ast.parse(source), "inject.cli", is_package=False, known=known) == {
        "inject.manifest",
        "inject.pods",
    }
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "one.py").write_text("def f():\n    import pkg.two\n")
    (tmp_path / "pkg" / "two.py").write_text("from pkg.one import f\n")
    assert cycles(import_graph.graph(tmp_path, ["pkg"])) == [["pkg.one", "pkg.two"]]
