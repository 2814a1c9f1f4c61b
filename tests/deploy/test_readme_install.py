"""The README's install commands run for real, in order, with kubectl against a new real API server: each apply is
taken, and what one kustomization set on an object is still there after the next one applied the same object.

``kubectl apply`` merges in three ways (the object as last applied, as now applied, as live;
staging/src/k8s.io/kubectl/pkg/cmd/apply/patcher.go): a label the first kustomization's copy of a shared object
declared and the second's leaves out is deleted from the live object. Each mode's commands get a control plane of
their own, so no object of one mode's install is left for the next.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import control_plane as plane
from tests.deploy.manifests import ROOT, Obj, have_kubectl, render

FENCED = re.compile(r"```sh\n(.*?)```", re.DOTALL)
APPLY = re.compile(r"kubectl apply -k (\S+)")


def readme_installs() -> list[list[str]]:
    """The directories each of the README's install blocks applies, in order (a block that applies a mode overlay)."""
    blocks = FENCED.findall((ROOT / "README.md").read_text())
    applied = [APPLY.findall(block) for block in blocks]
    return [directories for directories in applied if any(d.startswith("daemonset/") for d in directories)]


def test_the_readme_has_an_install_for_each_mode() -> None:
    assert sorted(d[0] for d in readme_installs()) == [
        "daemonset/imds-mode",
        "daemonset/karpenter-interruption",
        "daemonset/queue-mode",
    ]


@pytest.fixture
def kubeconfig(tmp_path: Path) -> Iterator[Path]:
    if (reason := plane.missing_reason()) is not None:
        pytest.skip(reason)
    if not have_kubectl():
        pytest.skip("kubectl is not installed: the README's commands cannot be run")
    directory = plane.temporary_directory()
    started = plane.start(directory)
    try:
        yield plane.write_kubeconfig(tmp_path / "kubeconfig", started.url, started.ca_path, started.admin_token)
    finally:
        started.stop()
        shutil.rmtree(directory, ignore_errors=True)


def kubectl(kubeconfig: Path, *args: str) -> str:
    done = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}:\n{done.stderr}"
    return done.stdout


def _key(obj: Obj) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


@pytest.mark.parametrize("directories", readme_installs(), ids=lambda directories: directories[0])
def test_the_readme_install_keeps_what_each_kustomization_set(kubeconfig: Path, directories: list[str]) -> None:
    declared: dict[tuple[str, str, str], list[tuple[str, dict[str, str]]]] = {}
    for directory in directories:
        kubectl(kubeconfig, "apply", "-k", str(ROOT / directory))
        for obj in render(directory):
            declared.setdefault(_key(obj), []).append((directory, obj["metadata"].get("labels") or {}))
    shared = {key: by for key, by in declared.items() if len(by) > 1}
    assert shared, "the install applies no object twice: nothing here is checked"
    for (kind, namespace, name), by in shared.items():
        where = ["-n", namespace] if namespace else []
        live: Obj = json.loads(kubectl(kubeconfig, "get", kind, name, *where, "-o", "json"))
        labels = live["metadata"].get("labels") or {}
        for directory, wanted in by:
            lost = {k: v for k, v in wanted.items() if labels.get(k) != v}
            assert not lost, f"{kind} {name}: {directory} set {lost}, gone after {' then '.join(directories)}"
