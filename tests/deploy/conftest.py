"""The real API server the manifests are sent to: the session's control plane (tests/conftest.py), shared by every
rendering."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import control_plane as plane
from tests.deploy.apiserver import DryRunServer


@pytest.fixture(scope="session")
def dry_run_server(control_plane: plane.ControlPlane) -> Iterator[DryRunServer]:
    server = DryRunServer(control_plane)
    server.install_crds()
    yield server
    server.close()
