"""Where the node agent looks for the API server: --kubeconfig, then the pod's account, then ~/.kube/config."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.drain.kube_config import ApiSource, api_source
from spotdrain.settings import SettingsError

IN_A_POD = {"KUBERNETES_SERVICE_HOST": "10.100.0.1", "KUBERNETES_SERVICE_PORT": "443"}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("apiVersion: v1\nkind: Config\n")
    return tmp_path


def test_a_given_kubeconfig_comes_first_even_in_a_pod(home: Path, tmp_path: Path) -> None:
    found = api_source("/etc/kube.yaml", env=IN_A_POD, home=home, token=tmp_path / "token")
    assert found == ApiSource("kubeconfig", "/etc/kube.yaml")


def test_in_a_pod_the_service_account_comes_before_the_home_kubeconfig(home: Path, tmp_path: Path) -> None:
    assert api_source(None, env=IN_A_POD, home=home, token=tmp_path / "token") == ApiSource("in-cluster")
    (tmp_path / "token").write_text("a-token")
    assert api_source(None, env={}, home=home, token=tmp_path / "token") == ApiSource("in-cluster")


def test_outside_a_cluster_the_home_kubeconfig_is_used(home: Path, tmp_path: Path) -> None:
    found = api_source(None, env={}, home=home, token=tmp_path / "no-token")
    assert found == ApiSource("home", str(home / ".kube" / "config"))
    assert found.describe() == f"kubeconfig {home / '.kube' / 'config'}"


def test_with_none_of_the_three_the_error_names_each(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as error:
        api_source(None, env={}, home=tmp_path, token=tmp_path / "no-token")
    for named in ("--kubeconfig", "KUBERNETES_SERVICE_HOST", str(tmp_path / ".kube" / "config")):
        assert named in str(error.value)
