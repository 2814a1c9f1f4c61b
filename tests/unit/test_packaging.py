from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("program", ["sidecar.main", "gateway.main"])
def test_the_sidecar_and_the_gateway_import_nothing_from_the_node_agents_dependencies(program: str) -> None:
    code = (
        f"import sys, agent.cli, {program}\n"
        "agent.cli.build_parser()  # every subcommand's flags, as `spotdrain sidecar` builds them\n"
        "heavy = [m for m in ('boto3', 'botocore', 'kubernetes_asyncio', 'yaml') if m in sys.modules]\n"
        "print(','.join(heavy))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == ""


def test_the_base_install_is_the_sidecars_and_the_node_agent_needs_an_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert "boto3" not in base
    assert "kubernetes" not in base
    assert any(dep.startswith("kubernetes-asyncio") for dep in project["optional-dependencies"]["node"])


def test_the_sidecar_image_runs_as_a_non_root_user_with_the_base_install_only() -> None:
    dockerfile = (ROOT / "Dockerfile.sidecar").read_text()
    assert "USER 65532:65532" in dockerfile
    assert "pip install --no-cache-dir --prefix=/install .\n" in dockerfile
    assert '["spotdrain", "sidecar"]' in dockerfile


def test_the_gateway_image_runs_as_a_non_root_user_with_the_base_install_only() -> None:
    dockerfile = (ROOT / "Dockerfile.gateway").read_text()
    assert "USER 65532:65532" in dockerfile
    assert "pip install --no-cache-dir --prefix=/install .\n" in dockerfile
    assert '["spotdrain", "gateway"]' in dockerfile
    assert "COPY sidecar" not in dockerfile
    assert "COPY daemonset" not in dockerfile
