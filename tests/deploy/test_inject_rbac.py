"""``spotdrain inject --readiness-gate`` prints the Role and RoleBinding the gate needs for each account of the pods
it changed (the account itself it names, never overwrites), never binds a namespace's ``default`` account, and with
``--no-gate-rbac`` says what each account must have instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from inject.manifest import inject_text, split_documents
from inject.rbac import gate_objects
from inject.spec import Options
from tests.deploy.manifests import grants, schema_errors
from tests.deploy.test_inject import RAY, VLLM
from tests.deploy.test_inject_keeps import _run

OWN = VLLM.replace("namespace: default", "namespace: ml").replace(
    "    spec:\n      containers:", "    spec:\n      serviceAccountName: vllm\n      containers:"
)
PATCH_STATUS = {("", "pods/status", "patch", "ml")}


def _objects(out: str) -> list[dict[str, object]]:
    return [doc for doc in yaml.safe_load_all(out) if doc]


def test_the_gate_comes_with_a_role_and_a_binding_that_grant_patch_on_pods_status(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _run(capsys, tmp_path, OWN, "--readiness-gate")
    assert code == 0
    objects = _objects(out)
    assert [o["kind"] for o in objects] == ["Deployment", "Role", "RoleBinding"]
    assert grants(objects, "ml", "vllm") == PATCH_STATUS
    assert {tuple(schema_errors(o)) for o in objects} == {()}
    assert split_documents(out)[0].text == inject_text(OWN, Options(readiness_gate=True)).text
    assert "added RoleBinding vllm-spotdrain-readiness-gate for the readiness gate" in err
    # Applied over an account applied from another file, a bare one would drop what that file set.
    assert "binds ServiceAccount ml/vllm, which the input does not define: it must exist" in err


def test_running_it_again_on_its_output_adds_nothing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _, once, _ = _run(capsys, tmp_path, OWN, "--readiness-gate")
    _, twice, _ = _run(capsys, tmp_path, once, "--readiness-gate")
    assert twice == once


def test_objects_the_input_has_already_are_not_printed_again(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    account = "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: vllm, namespace: ml}\n"
    role = "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\n"
    role += "metadata: {name: spotdrain-readiness-gate, namespace: ml}\n"
    _, out, err = _run(capsys, tmp_path, account + "---\n" + role + "---\n" + OWN, "--readiness-gate")
    assert [o["kind"] for o in _objects(out)] == ["ServiceAccount", "Role", "Deployment", "RoleBinding"]
    assert "does not define" not in err


def test_one_role_per_namespace_and_one_binding_per_account() -> None:
    objects = gate_objects([("ml", "a"), ("ml", "b"), ("ml", "a"), (None, "a")], set())
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    roles = [n for n in names if n[0] == "Role"]
    assert roles == [("Role", "ml", "spotdrain-readiness-gate"), ("Role", None, "spotdrain-readiness-gate")]
    assert len([n for n in names if n[0] == "RoleBinding"]) == 3
    assert len(set(names)) == len(names)
    assert {n[0] for n in names} == {"Role", "RoleBinding"}, "the account itself is never printed"


def test_a_binding_without_a_namespace_binds_the_account_of_the_namespace_it_is_applied_in() -> None:
    objects = gate_objects([(None, "vllm")], set())
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "vllm"}]
    assert {tuple(schema_errors(o)) for o in objects} == {()}


@pytest.mark.parametrize("text", [VLLM, RAY], ids=["no-account", "ray-no-account"])
def test_the_default_account_is_not_bound_and_a_dedicated_one_is_advised(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str
) -> None:
    code, out, err = _run(capsys, tmp_path, text, "--readiness-gate")
    assert code == 0
    assert [o["kind"] for o in _objects(out)] == [yaml.safe_load(text)["kind"]]
    assert "runs as its namespace's default ServiceAccount, which is not granted patch on pods/status" in err
    assert "name it in serviceAccountName" in err


def test_no_gate_rbac_prints_none_and_says_what_the_account_must_have(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _run(capsys, tmp_path, OWN, "--readiness-gate", "--no-gate-rbac")
    assert (code, out) == (0, inject_text(OWN, Options(readiness_gate=True)).text)
    said = "warning: Deployment ml/vllm spec.template.spec: its ServiceAccount 'vllm' must have patch on pods/status"
    assert said in err


def test_without_the_gate_no_rbac_is_printed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    _, out, err = _run(capsys, tmp_path, OWN)
    assert [o["kind"] for o in _objects(out)] == ["Deployment"]
    assert "pods/status" not in err
