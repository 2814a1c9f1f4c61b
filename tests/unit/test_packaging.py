from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spotdrain.cli import _installed
from tests.unit.import_graph import PROGRAMS, copied_packages

ROOT = Path(__file__).resolve().parents[2]


# Runs before the code under test: the project's packages an image does not copy cannot be imported, as in the image.
ABSENT = """
import sys
class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name.partition(".")[0])
sys.meta_path.insert(0, Absent())
"""


def _in_image(dockerfile: str, code: str) -> list[str]:
    """What ``code`` prints, run with only the packages ``dockerfile`` copies (and every third-party module)."""
    absent = sorted(set(PROGRAMS) - copied_packages(dockerfile))
    program = f"ABSENT = {absent!r}\n{ABSENT}\n{code}"
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout.split()


COMMANDS = "print(*spotdrain.cli.build_parser()._subparsers._group_actions[0].choices)\n"


def test_the_sidecar_image_has_its_command_and_nothing_of_the_node_agent_or_its_dependencies() -> None:
    assert copied_packages("Dockerfile.sidecar") == {"spotdrain", "sidecar"}
    loaded = _in_image(
        "Dockerfile.sidecar",
        "import spotdrain.cli, sidecar.main\n"
        + COMMANDS
        + "spotdrain.cli.build_parser().parse_args(['sidecar', '--engine', 'vllm'])\n"
        "print(*[m for m in ('boto3', 'botocore', 'kubernetes_asyncio', 'yaml') if m in sys.modules])\n",
    )
    assert loaded == ["sidecar"]


def test_the_gateway_image_has_its_command_and_nothing_of_the_node_agent_or_its_dependencies() -> None:
    assert copied_packages("Dockerfile.gateway") == {"spotdrain", "gateway"}
    loaded = _in_image(
        "Dockerfile.gateway",
        "import spotdrain.cli, gateway.main\n"
        + COMMANDS
        + "print(*[m for m in ('boto3', 'botocore', 'kubernetes_asyncio', 'yaml') if m in sys.modules])\n",
    )
    assert loaded == ["gateway"]


def test_the_agent_image_has_the_node_cache_and_check_commands_and_no_sidecar() -> None:
    assert copied_packages("Dockerfile.agent") == {"spotdrain", "agent", "check"}
    commands = _in_image("Dockerfile.agent", "import spotdrain.cli, agent.main, agent.cache.run\n" + COMMANDS)
    assert commands == ["node", "cache", "check"]


def test_the_webhook_image_has_its_commands_and_no_node_agent_or_sidecar() -> None:
    assert copied_packages("Dockerfile.webhook") == {"spotdrain", "inject", "webhook"}
    loaded = _in_image(
        "Dockerfile.webhook",
        "import spotdrain.cli, webhook.server, webhook.selfmanaged\n"
        + COMMANDS
        + "args = spotdrain.cli.build_parser().parse_args(['webhook', '--tls-cert', 'c', '--tls-key', 'k'])\n"
        "import webhook.settings; webhook.settings.from_arguments(args)\n"
        "print(*[m for m in ('boto3', 'kubernetes_asyncio', 'yaml', 'sidecar', 'agent') if m in sys.modules])\n",
    )
    assert loaded == ["inject", "webhook"]  # PyYAML is loaded only when inject runs


def test_the_webhook_image_runs_as_a_non_root_user_with_the_webhook_and_inject_extras() -> None:
    dockerfile = (ROOT / "Dockerfile.webhook").read_text()
    assert "USER 65532:65532" in dockerfile
    assert "pip install --no-cache-dir --prefix=/install '.[webhook,inject]'\n" in dockerfile
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [dep.partition(">")[0] for dep in extras["webhook"] + extras["inject"]] == ["cryptography", "pyyaml"]


def test_a_program_that_is_not_installed_has_no_command_but_a_missing_dependency_still_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _installed("spotdrain_program_not_here.settings") is None
    (tmp_path / "broken_program").mkdir()
    (tmp_path / "broken_program" / "__init__.py").write_text("")
    (tmp_path / "broken_program" / "settings.py").write_text("import dependency_not_installed_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="dependency_not_installed_anywhere"):
        _installed("broken_program.settings")


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


def test_the_gateway_image_runs_as_a_non_root_user_with_the_base_install_uvloop_and_orjson_only() -> None:
    dockerfile = (ROOT / "Dockerfile.gateway").read_text()
    assert "USER 65532:65532" in dockerfile
    assert "SPOTDRAIN_COMPILE=1 /build/bin/pip wheel" in dockerfile  # the relay path compiled (setup.py)
    assert 'pip install --no-cache-dir --prefix=/install "$(ls /wheels/spotdrain-*.whl)[gateway]"\n' in dockerfile
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gateway"]
    assert [dep.partition(">")[0] for dep in extra] == ["uvloop", "orjson"]
    assert '["spotdrain", "gateway"]' in dockerfile
