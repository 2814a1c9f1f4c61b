"""The gateway as its image ships it, its relay path compiled (setup.py, ``SPOTDRAIN_COMPILE=1``; bench/compiled.py
builds it): each compiled module loads as a C extension, and the gateway's unit and integration tests, and its
continuations of real vLLM's streams, pass against them as they do against the source."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compiled import Unbuilt, built
from tests.install.engine import ROOT

TESTS = ("unit/test_gateway*.py", "integration/test_gateway*.py", "integration/test_http1.py")
# Its continuations of real vLLM's streams, dropped anywhere (make test-engines builds vLLM). The parsed chats' tests
# (tests/engines/test_gateway_reasoning.py) are left to that tier, from the source: with them, this tier took about 13
# of its 15 minutes.
ENGINE_TESTS = ("engines/test_gateway_vllm.py",)
# Tests that hand the relay a stand-in for the client's connection (a recorder, a Mock) or replace a module's
# function from outside: compiled code takes only a gateway.server.Connection where its type says so, and calls its
# own module's functions directly. What they check runs with real connections in the integration tests.
STAND_INS = (
    "unit/test_gateway_chunk_shape.py::test_split_reads_and_merged_events_reach_the_client_as_the_full_parse_relays_them",
    "unit/test_gateway_chunk_shape.py::test_a_finish_read_with_its_done_goes_out_with_the_streams_end_in_one_write",
    "unit/test_gateway_chunk_shape.py::test_a_finish_read_alone_goes_out_at_once",
    "unit/test_gateway_chunk_shape.py::test_a_vllm_stream_is_parsed_for_its_first_chunks_only",
    "integration/test_gateway_relay_connect.py::test_a_backend_that_takes_no_connection_is_a_timeout_named_by_the_connect_timeout",
)
RUN_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def compiled() -> Path:
    found = built()
    if isinstance(found, Unbuilt):
        pytest.skip(found.reason)
    return found


@pytest.fixture(scope="module")
def tree(compiled: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled package beside a copy of the tests: run from there, the compiled modules are the ones imported
    (from the source tree, its own would be)."""
    tree = tmp_path_factory.mktemp("compiled-tree")
    for entry in compiled.iterdir():
        if not entry.name.endswith(".dist-info") and entry.name != "bin":
            (tree / entry.name).symlink_to(entry)
    (tree / "bench").symlink_to(ROOT / "bench")  # the benchmarks' backend, which a test runs
    shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def compiled_modules() -> list[str]:
    """The modules setup.py compiles (its ``COMPILED``), as the gateway imports them."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    listed = next(n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "COMPILED")
    return [path.removesuffix(".py").replace("/", ".") for path in ast.literal_eval(listed)]


def test_the_relay_path_loads_as_c_extensions(tree: Path) -> None:
    modules = compiled_modules()
    assert "gateway.relay" in modules
    script = "import importlib, sys\nfor name in sys.argv[1:]: print(importlib.import_module(name).__file__)"
    done = subprocess.run(
        [sys.executable, "-c", script, *modules], cwd=tree, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    files = done.stdout.split()
    assert len(files) == len(modules)
    assert all(Path(f).name.endswith(".so") and Path(f).is_relative_to(tree) for f in files), files


def test_the_gateways_tests_pass_against_it(tree: Path) -> None:
    summary = _passed(tree, TESTS, STAND_INS)
    assert f"{len(STAND_INS)} deselected" in summary, summary


def test_its_continuations_of_real_vllm_streams_are_the_uninterrupted_ones(tree: Path) -> None:
    """The real-engine tier's gateway tests (its vLLM, built by ``make test-engines``, which ``.ci/run`` runs first;
    where there is none, they skip with their reason, and so does this)."""
    summary = _passed(tree, ENGINE_TESTS, (), env={"SPOTDRAIN_ENGINE_TIER": "1"})
    if " passed" not in summary:
        pytest.skip(f"the real-engine tests did not run: {summary}")


def _passed(
    tree: Path, patterns: tuple[str, ...], deselected: tuple[str, ...], env: dict[str, str] | None = None
) -> str:
    """pytest's summary line of the tests ``patterns`` name, run from ``tree``; fails where one failed."""
    files = sorted(str(p.relative_to(tree)) for pattern in patterns for p in (tree / "tests").glob(pattern))
    assert len(files) >= len(patterns), files
    argv = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *files]
    argv += [f"--deselect=tests/{test}" for test in deselected]
    done = subprocess.run(
        argv,
        cwd=tree,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    lines = done.stdout.strip().splitlines() or [done.stderr[-2000:]]
    assert done.returncode == 0, "\n".join(lines[-60:]) + done.stderr[-2000:]
    return lines[-1]
