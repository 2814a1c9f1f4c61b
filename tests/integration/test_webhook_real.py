"""The admission webhook as the real API server calls it: deploy/webhook/base's MutatingWebhookConfiguration
pointed at ``spotdrain webhook``'s app on 127.0.0.1, and Pods created through the API server."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.control_plane import ControlPlane
from tests.deploy.test_inject import VLLM
from tests.real_kube import RealKube
from tests.real_webhook import serving_webhook

Obj = dict[str, Any]


@pytest.fixture
async def real(control_plane: ControlPlane, tmp_path: Path) -> AsyncIterator[RealKube]:
    async with RealKube(control_plane) as kube:
        kube.admin.patch("/api/v1/namespaces/inference", {"metadata": {"labels": {"spotdrain.io/inject": "true"}}})
        async with serving_webhook(kube, tmp_path, {"MutatingWebhookConfiguration"}):
            yield kube
        kube.admin.patch("/api/v1/namespaces/inference", {"metadata": {"labels": {"spotdrain.io/inject": None}}})


async def create(kube: RealKube, pod: Obj) -> httpx.Response:
    """Create ``pod`` in ``inference`` as a client would (asynchronously: the webhook answers in this loop)."""
    context = ssl.create_default_context(cafile=str(kube.plane.ca_path))
    headers = {"Authorization": f"Bearer {kube.plane.admin_token}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=kube.plane.url, verify=context, timeout=15, headers=headers) as client:
        return await client.post("/api/v1/namespaces/inference/pods", content=json.dumps(pod))


def vllm_pod(name: str) -> Obj:
    template = yaml.safe_load(VLLM)["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template.get("metadata", {})},
            "spec": template["spec"]}  # fmt: skip


async def test_a_pod_created_in_a_labelled_namespace_is_stored_with_the_sidecar(real: RealKube) -> None:
    answer = await create(real, vllm_pod("vllm-0"))
    assert answer.status_code == 201, answer.text
    stored = real.pod("inference", "vllm-0") or {}
    names = [c["name"] for c in stored["spec"]["containers"]]
    assert "spotdrain" in names
    engine = next(c for c in stored["spec"]["containers"] if c["name"] != "spotdrain")
    assert engine["lifecycle"]["preStop"]["exec"]["command"][0] == "/bin/sh"


async def test_a_pod_it_cannot_handle_is_created_as_it_came_with_the_warning(real: RealKube) -> None:
    pause = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pause"},
             "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}]}}  # fmt: skip
    answer = await create(real, pause)
    assert answer.status_code == 201, answer.text
    assert [c["name"] for c in answer.json()["spec"]["containers"]] == ["main"]
    assert "spotdrain: the sidecar was not added" in answer.headers.get("warning", "")
