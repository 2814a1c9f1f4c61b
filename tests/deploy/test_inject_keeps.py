"""``spotdrain inject`` keeps what the user wrote: the engine's own probes stay, a value it must change is named on
standard error, an object that is not valid is named and left alone (or refused with ``--strict``), and a pod it
cannot give the sidecar says which containers it saw and how to pick one."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from inject.manifest import inject_text
from inject.spec import Options
from inject.validate import missing_fields
from spotdrain.cli import main
from tests.deploy.manifests import Obj, schema_errors
from tests.deploy.test_inject import RAY, SGLANG_POD, TGI, VLLM

PROBE = """\
          readinessProbe:
            httpGet: {path: /health, port: 8000}
            initialDelaySeconds: 60
            periodSeconds: 7
"""


@pytest.fixture(autouse=True)
def _logging_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("spotdrain.cli.configure_logging", lambda **_: None)


def _run(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, *argv: str) -> tuple[int, str, str]:
    path = tmp_path / "app.yaml"
    path.write_text(text)
    code = main(["inject", "-f", str(path), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _spec(text: str) -> Obj:
    spec: Obj = next(yaml.safe_load_all(text))["spec"]["template"]["spec"]
    return spec


# Readiness: the AND of the containers' ----------------------------------------------------------------------------


def test_the_engines_own_readiness_probe_is_kept_exactly_as_written() -> None:
    text = VLLM + PROBE
    engine, sidecar = _spec(inject_text(text, Options()).text)["containers"]
    assert engine["readinessProbe"] == _spec(text)["containers"][0]["readinessProbe"]
    assert engine["readinessProbe"]["initialDelaySeconds"] == 60
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8081}


def test_scalars_kubectl_reads_as_strings_stay_the_strings_they_were() -> None:
    # YAML 1.1 reads 1:30 as 90 (base 60) and 2026-01-01T10:00:00Z as a datetime; kubectl reads both as strings.
    text = (
        VLLM
        + "          env:\n            - {name: T, value: 1:30}\n            - {name: W, value: 2026-01-01T10:00:00Z}\n"
    )
    engine = _spec(inject_text(text, Options()).text)["containers"][0]
    assert engine["env"][:2] == [{"name": "T", "value": "1:30"}, {"name": "W", "value": "2026-01-01T10:00:00Z"}]


@pytest.mark.parametrize("text", [VLLM, VLLM + PROBE, TGI, RAY], ids=["no-probe", "own-probe", "tgi", "ray"])
def test_the_pod_leaves_rotation_at_the_first_503_of_the_sidecars_ready(text: str) -> None:
    # A pod is Ready when every container is: the sidecar's probe alone, failing once, takes it out.
    for document in yaml.safe_load_all(inject_text(text, Options()).text):
        specs = [document["spec"]["template"]["spec"]] if "template" in document["spec"] else []
        specs += [g["template"]["spec"] for g in document["spec"].get("workerGroupSpecs", [])]
        for spec in specs:
            [sidecar] = [c for c in spec["containers"] if c["name"] == "spotdrain"]
            probe = sidecar["readinessProbe"]
            assert (probe["httpGet"]["path"], probe["failureThreshold"], probe["periodSeconds"]) == ("/ready", 1, 5)
            engines = [c for c in spec["containers"] if c is not sidecar]
            assert all(c.get("readinessProbe", {}).get("httpGet", {}).get("path") != "/ready" for c in engines)


# Values of the user's that change are named ------------------------------------------------------------------------


def test_a_grace_period_the_user_set_too_short_is_raised_and_named_with_both_values(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = VLLM.replace("      containers:\n", "      terminationGracePeriodSeconds: 45\n      containers:\n")
    code, out, err = _run(capsys, tmp_path, text)
    assert (code, _spec(out)["terminationGracePeriodSeconds"]) == (0, 130)
    said = "warning: Deployment default/vllm spec.template.spec: terminationGracePeriodSeconds raised from 45 to 130"
    assert said in err
    assert "drain timeout (110 s)" in err


@pytest.mark.parametrize("text", [VLLM, TGI], ids=["unset", "long-enough"])
def test_a_grace_period_left_as_the_user_wrote_it_or_unset_is_not_a_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str
) -> None:
    code, _, err = _run(capsys, tmp_path, text)
    assert (code, "terminationGracePeriodSeconds" in err) == (0, False)


def test_a_mount_of_the_users_where_the_drain_directory_goes_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = VLLM + "          volumeMounts:\n            - {name: scratch, mountPath: /run/spotdrain}\n"
    code, out, err = _run(capsys, tmp_path, text)
    assert (code, out) == (2, "")
    assert "container 'vllm' already mounts 'scratch' at /run/spotdrain" in err


# Objects that are not valid ----------------------------------------------------------------------------------------

INVALID = [
    (VLLM.replace("  selector:\n    matchLabels: {app: vllm}\n", ""), "spec.selector"),
    (
        VLLM.replace("        - name: vllm\n          image:", "        - image:"),
        "spec.template.spec.containers[0].name",
    ),
    (VLLM.split("  template:\n")[0], "spec.template"),
    (SGLANG_POD.replace("    - name: client\n      image", "    - image"), "spec.containers[1].name"),
    (RAY.replace("    - groupName: gpu\n      replicas", "    - replicas"), "spec.workerGroupSpecs[0].groupName"),
]
KINDS = {"Deployment": "apps/v1 Deployment", "Pod": "v1 Pod", "RayCluster": "ray.io/v1 RayCluster"}


@pytest.mark.parametrize(("text", "field"), INVALID, ids=[field for _, field in INVALID])
def test_an_object_without_a_required_field_is_named_and_left_as_it_is(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, field: str
) -> None:
    code, out, err = _run(capsys, tmp_path, "# first\n---\n" + text)
    assert (code, out) == (0, "# first\n---\n" + text)
    kind = yaml.safe_load(text)["kind"]
    assert f"warning: document 2 (line 2), {kind} " in err
    assert f"{field} is missing: not a valid {KINDS[kind]}; left as it is" in err


@pytest.mark.parametrize(("text", "field"), INVALID, ids=[field for _, field in INVALID])
def test_strict_makes_an_object_without_a_required_field_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, field: str
) -> None:
    code, out, err = _run(capsys, tmp_path, text, "--strict")
    assert (code, out) == (2, "")
    assert "error: document 1 (line 1)" in err
    assert f"{field} is missing" in err


@pytest.mark.parametrize(("text", "field"), INVALID, ids=[field for _, field in INVALID])
def test_the_required_fields_are_what_the_kinds_schemas_require(text: str, field: str) -> None:
    obj = yaml.safe_load(text)
    assert missing_fields(obj) == [field]
    assert schema_errors(obj) != [], "the schema the API server uses refuses it too"


@pytest.mark.parametrize("text", [VLLM, TGI, SGLANG_POD, RAY])
def test_a_valid_object_has_every_required_field(text: str) -> None:
    obj = yaml.safe_load(text)
    assert (missing_fields(obj), schema_errors(obj)) == ([], [])


def test_a_pod_template_without_containers_is_missing_them_although_its_spec_is_optional() -> None:
    obj: dict[str, Any] = yaml.safe_load(VLLM)
    del obj["spec"]["template"]["spec"]
    assert missing_fields(obj) == ["spec.template.spec.containers"]
    broken = copy.deepcopy(obj)
    broken["spec"]["template"]["spec"] = {"containers": None}
    assert missing_fields(broken) == ["spec.template.spec.containers"]


# A pod it cannot give the sidecar ----------------------------------------------------------------------------------

WEB = VLLM.replace(
    "- name: vllm\n          image: vllm/vllm-openai:v0.11.0", "- name: web\n          image: nginx:1.27"
)


def test_a_pod_without_an_engine_names_its_containers_and_the_flag_that_picks_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = _run(capsys, tmp_path, WEB)
    assert (code, out) == (0, WEB)
    said = "note: Deployment default/vllm spec.template.spec: not given the sidecar: no vLLM, TGI or SGLang container"
    assert said in err
    assert "among web (nginx:1.27); name the engine's with --container NAME" in err


def test_a_ray_group_without_gpus_is_said_to_run_no_engine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _run(capsys, tmp_path, RAY)
    assert code == 0
    assert "RayCluster llm spec.headGroupSpec.template.spec: not given the sidecar: a Ray group without GPUs" in err
    assert "added the sidecar to RayCluster llm spec.workerGroupSpecs[0].template.spec" in err


def test_a_key_given_twice_is_refused_rather_than_one_value_dropped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text = VLLM.replace(
        "          image: vllm/vllm-openai:v0.11.0\n", "          image: vllm/vllm-openai:v0.11.0\n          image: x\n"
    )
    code, out, err = _run(capsys, tmp_path, text)
    assert (code, out) == (2, "")
    assert "document 1 (line 1): key 'image' given twice in one mapping (lines 15 and 16); keep one" in err


def test_a_key_a_merge_brings_may_be_overridden() -> None:
    text = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\nbase: &b {a: 1}\ndata:\n  <<: *b\n  a: '2'\n"
    assert inject_text(text, Options()).text == text
