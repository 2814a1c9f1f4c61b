"""``spotdrain inject``: the sidecar and its wiring added to inference workloads, everything else left as it was."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from inject import spec
from inject.engines import COMMAND_WORDS, engine_of
from inject.manifest import inject_text, split_documents
from inject.spec import InjectError, Options, command_line
from sidecar.engines import RAY_DEFAULT_LAG_S, RAY_LAG_AT_1000_MS_S
from sidecar.gate import CONDITION
from sidecar.settings import SidecarSettings
from spotdrain.cli import build_parser, main
from tests.deploy.manifests import (
    DEPLOY,
    Obj,
    PodTemplate,
    invocation,
    one,
    parse,
    pod_templates,
    render,
    schema_errors,
)

VLLM = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: vllm
  namespace: default
spec:
  selector:
    matchLabels: {app: vllm}
  template:
    metadata:
      labels: {app: vllm}
    spec:
      containers:
        - name: vllm
          image: vllm/vllm-openai:v0.11.0
          args: ["--model", "Qwen/Qwen2.5-7B-Instruct"]
          ports:
            - containerPort: 8000
          resources:
            limits: {nvidia.com/gpu: "1"}
"""
TGI = """\
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: tgi
spec:
  serviceName: tgi
  selector:
    matchLabels: {app: tgi}
  template:
    metadata:
      labels: {app: tgi}
    spec:
      terminationGracePeriodSeconds: 300
      containers:
        - name: server
          image: ghcr.io/huggingface/text-generation-inference:3.3.4
          args: ["--model-id", "Qwen/Qwen2.5-7B-Instruct", "--port", "8080"]
"""
SGLANG_POD = """\
apiVersion: v1
kind: Pod
metadata:
  name: sglang
spec:
  containers:
    - name: server
      image: lmsysorg/sglang:v0.5.3
      command: ["python3", "-m", "sglang.launch_server", "--model-path", "x", "--enable-metrics"]
    - name: client
      image: curlimages/curl:8.10.1
      args: ["-s", "http://vllm:8000/v1/models"]
"""
RAY = """\
apiVersion: ray.io/v1
kind: RayCluster
metadata:
  name: llm
spec:
  headGroupSpec:
    rayStartParams: {num-gpus: "0"}
    template:
      spec:
        containers:
          - name: ray-head
            image: rayproject/ray-llm:2.49.0-py311-cu128
  workerGroupSpecs:
    - groupName: gpu
      replicas: 1
      minReplicas: 1
      maxReplicas: 4
      rayStartParams: {num-gpus: "1", metrics-export-port: "9090"}
      template:
        spec:
          containers:
            - name: ray-worker
              image: rayproject/ray-llm:2.49.0-py311-cu128
              resources:
                limits: {nvidia.com/gpu: "1"}
"""
CONFIG_MAP = """\
# Settings, formatted the way their author likes them.
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}   # flow style stays flow style
data:
  quoted: 'single'
  block: |
    kept as
    written
"""
SERVICE = """\
apiVersion: v1
kind: Service
metadata:
  name: vllm
spec:
  selector: {app: vllm}
  ports: [{port: 8000}]
"""


def _inject(text: str, **options: Any) -> str:
    return inject_text(text, Options(**options)).text


def _pods(text: str) -> list[PodTemplate]:
    return pod_templates([doc for doc in yaml.safe_load_all(text) if doc])


def _sidecar(
    text: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[SidecarSettings, Obj]:
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    for template in pod_templates(objects) or [_pod(objects[0])]:
        for container in template.containers:
            call = invocation(template.name, container, objects)
            if call is not None:
                settings: SidecarSettings = parse(call, monkeypatch, capsys)
                return settings, template.spec
    raise AssertionError("no sidecar")


def _pod(pod: Obj) -> PodTemplate:
    return PodTemplate(pod, "spec", pod["metadata"].get("labels", {}), pod["spec"])


@pytest.fixture(autouse=True)
def _logging_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # The command would point structlog at this test's captured stderr, which later tests would then write to.
    monkeypatch.setattr("spotdrain.cli.configure_logging", lambda **_: None)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["inject", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inject_uses_the_names_the_sidecar_and_the_agent_use() -> None:
    sidecar, node = build_parser().parse_args(["sidecar"]), build_parser().parse_args(["node", "--node-name", "n"])
    assert (sidecar.port, str(sidecar.drain_dir), CONDITION) == (spec.SIDECAR_PORT, spec.DRAIN_DIR, spec.GATE)
    assert Options().drain_timeout_s == sidecar.drain_timeout
    assert f"http://$(HOST_IP):{node.notice_port}/v1/notice" == spec.DEFAULT_NOTICE_URL
    assert spec.RAY_LAG_INTERVALS == RAY_LAG_AT_1000_MS_S  # the wait at 1000 ms, the least Ray takes


def test_a_vllm_deployment_gets_the_sidecar_probe_prestop_volume_and_grace(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _inject(VLLM)
    settings, spec = _sidecar(out, monkeypatch, capsys)
    engine, sidecar = spec["containers"]
    assert [c["name"] for c in spec["containers"]] == ["vllm", "spotdrain"]
    assert (settings.engine.kind, settings.engine.port, settings.drain.timeout_s) == ("vllm", 8000, 110.0)
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": settings.port}
    assert "readinessProbe" not in engine, "the user wrote none"
    assert engine["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", f"{settings.drain.dir}/prestop"]
    assert {"name": "spotdrain", "mountPath": str(settings.drain.dir)} in engine["volumeMounts"]
    assert {"name": "spotdrain", "emptyDir": {}} in spec["volumes"]
    assert spec["terminationGracePeriodSeconds"] == 130
    assert settings.drain.notice_url == "http://10.0.0.1:8090/v1/notice"
    assert schema_errors(yaml.safe_load(out)) == []


def test_a_tgi_statefulset_keeps_its_longer_grace_and_is_read_on_its_own_port(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _inject(TGI)
    settings, spec = _sidecar(out, monkeypatch, capsys)
    assert (settings.engine.kind, settings.engine.port) == ("tgi", 8080)
    assert spec["terminationGracePeriodSeconds"] == 300
    assert schema_errors(yaml.safe_load(out)) == []


def test_a_longer_drain_timeout_lengthens_the_grace_period(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings, spec = _sidecar(_inject(VLLM, drain_timeout_s=200.5), monkeypatch, capsys)
    assert settings.drain.timeout_s == 200.5
    assert spec["terminationGracePeriodSeconds"] == 221


def test_an_sglang_pod_gets_the_sidecar_and_its_client_container_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _inject(SGLANG_POD)
    settings, spec = _sidecar(out, monkeypatch, capsys)
    assert (settings.engine.kind, settings.engine.port) == ("sglang", 30000)
    client = next(c for c in spec["containers"] if c["name"] == "client")
    assert "readinessProbe" not in client
    assert "lifecycle" not in client
    assert schema_errors(yaml.safe_load(out)) == []


def test_a_proxy_told_where_the_engines_are_runs_none() -> None:
    """The shipped gateway's command names the engines' Service (``--service=inference/vllm``), in a namespace
    labelled for injection: a flag's value is not an engine's name."""
    gateway = one(render("deploy/gateway"), "Deployment", "spotdrain-gateway")
    container = gateway["spec"]["template"]["spec"]["containers"][0]
    assert any("vllm" in word for word in command_line(container)[:COMMAND_WORDS])
    assert engine_of(container) is None
    assert engine_of({"name": "engine", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"]}) == "vllm"


def test_a_ray_clusters_gpu_workers_get_the_sidecar_and_the_cpu_head_does_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _inject(RAY)
    head, worker = _pods(out)
    assert [c["name"] for c in head.containers] == ["ray-head"]
    assert [c["name"] for c in worker.containers] == ["ray-worker", "spotdrain"]
    settings, _ = _sidecar(out, monkeypatch, capsys)
    assert (settings.engine.kind, settings.engine.port) == ("ray", 9090)
    assert settings.drain.zero_confirm_s == RAY_DEFAULT_LAG_S  # Ray's default export: its page lags up to 15 s
    assert worker.spec["terminationGracePeriodSeconds"] == 130
    assert schema_errors(yaml.safe_load(out)) == []


@pytest.mark.parametrize(("interval", "wait_s"), [("1000", 1.5), ("250", 1.5), ("5000", 7.5)])
def test_a_ray_worker_that_sets_its_export_interval_is_waited_for_as_long_as_its_page_lags(
    interval: str, wait_s: float, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ray takes no less than 1000 ms (src/ray/stats/stats.h), and its page shows a stream's end up to 1.5
    intervals late (docs/sidecar.md)."""
    env = f"              env: [{{name: RAY_metrics_report_interval_ms, value: '{interval}'}}]\n"
    settings, _ = _sidecar(_inject(RAY + env), monkeypatch, capsys)
    assert (settings.engine.kind, settings.drain.zero_confirm_s) == ("ray", wait_s)


def test_other_documents_are_kept_byte_for_byte() -> None:
    text = "\n---\n".join((CONFIG_MAP, VLLM, "# a service\n" + SERVICE))
    out = _inject(text)
    before, after = split_documents(text), split_documents(out)
    assert [d.text for d in after][0::2] == [d.text for d in before][0::2]
    assert after[1].text != before[1].text
    assert after[1].text.startswith("---\n")


def test_comments_around_a_changed_document_stay() -> None:
    out = _inject("# the engine\n" + VLLM + "# end of the engine\n")
    assert out.startswith("# the engine\napiVersion: apps/v1\n")
    assert out.endswith("# end of the engine\n")


def test_windows_line_endings_are_kept_in_a_changed_document() -> None:
    text = (CONFIG_MAP + "---\n" + VLLM).replace("\n", "\r\n")
    out = _inject(text)
    assert out.startswith(CONFIG_MAP.replace("\n", "\r\n") + "---\r\n")
    assert "\n" not in out.replace("\r\n", "")


def test_a_directive_before_the_first_document_is_not_an_object() -> None:
    out = _inject("%YAML 1.1\n---\n" + VLLM)
    assert out.startswith("%YAML 1.1\n---\n")
    assert "spotdrain" in out


def test_injecting_twice_changes_nothing_more() -> None:
    text = "---\n".join((CONFIG_MAP, VLLM, TGI, RAY, SGLANG_POD))
    once = _inject(text)
    assert once != text
    assert _inject(once) == once


@pytest.mark.parametrize("path", ["vllm/deployment.yaml", "kuberay/raycluster.yaml"])
def test_the_shipped_manifests_already_have_everything(path: str) -> None:
    text = (DEPLOY / path).read_text()
    assert _inject(text, readiness_gate=True) == text


def test_readiness_gate_adds_the_condition_and_the_pods_identity(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings, spec = _sidecar(_inject(VLLM, readiness_gate=True), monkeypatch, capsys)
    assert settings.gate.enabled
    assert settings.gate.pod_name == "pod-0"
    assert spec["readinessGates"] == [{"conditionType": "spotdrain.io/serving"}]


@pytest.mark.parametrize("text", [VLLM, RAY], ids=["deployment", "raycluster"])
def test_readiness_gate_mounts_the_accounts_token_in_the_sidecar_alone(
    text: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _inject(text, readiness_gate=True)
    settings, spec = _sidecar(out, monkeypatch, capsys)
    token_dir = str(settings.gate.serviceaccount_dir)
    mounting = {
        c["name"]: m["name"]
        for c in spec["containers"]
        for m in c.get("volumeMounts", [])
        if m["mountPath"] == token_dir
    }
    assert list(mounting) == ["spotdrain"]
    [volume] = [v for v in spec["volumes"] if v["name"] == mounting["spotdrain"]]
    sources = volume["projected"]["sources"]
    assert sources[0]["serviceAccountToken"]["path"] == "token"
    assert sources[1]["configMap"] == {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    namespace = {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
    assert sources[2]["downwardAPI"]["items"] == [namespace]
    assert schema_errors(next(yaml.safe_load_all(out))) == []
    assert _inject(out, readiness_gate=True) == out


def test_without_the_gate_no_token_is_mounted() -> None:
    assert "serviceaccount" not in _inject(VLLM)


def test_a_volume_of_the_users_under_the_token_volumes_name_is_refused() -> None:
    text = VLLM + "      volumes:\n        - name: spotdrain-token\n          emptyDir: {}\n"
    with pytest.raises(InjectError, match="spotdrain-token"):
        _inject(text, readiness_gate=True)


def test_no_notice_url_means_no_host_ip(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    settings, spec = _sidecar(_inject(VLLM, notice_url=None), monkeypatch, capsys)
    assert settings.drain.notice_url is None
    assert "env" not in spec["containers"][1]


def test_a_named_container_is_injected_with_the_engine_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text = VLLM.replace("vllm/vllm-openai:v0.11.0", "registry.example/llm-server:7")
    assert _inject(text) == text
    settings, _ = _sidecar(_inject(text, container="vllm", engine="vllm"), monkeypatch, capsys)
    assert settings.engine.kind == "vllm"


def test_the_command_reads_a_file_and_reports_what_it_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(CONFIG_MAP + "---\n" + VLLM)
    code, out, err = _run(capsys, "-f", str(path), "--drain-timeout", "60")
    assert code == 0
    assert out == _inject(CONFIG_MAP + "---\n" + VLLM, drain_timeout_s=60.0)
    assert "Deployment default/vllm spec.template.spec" in err


BUDGET = """\
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: vllm
  namespace: default
spec:
  maxUnavailable: 1
  selector:
    matchLabels: {app: vllm}
"""


def test_a_budget_without_always_allow_is_named_in_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(VLLM + "---\n" + BUDGET)
    code, out, err = _run(capsys, "-f", str(path))
    assert code == 0
    assert out.endswith(BUDGET), "the budget itself is left as the user wrote it"
    warning = "warning: PodDisruptionBudget default/vllm has no unhealthyPodEvictionPolicy: AlwaysAllow"
    assert warning in err
    path.write_text(VLLM + "---\n" + BUDGET + "  unhealthyPodEvictionPolicy: AlwaysAllow\n")
    code, _, err = _run(capsys, "-f", str(path))
    assert (code, "warning" in err, "note" in err) == (0, False, False)


def test_a_budget_inside_a_list_is_named_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `kubectl get deploy,pdb -o yaml` prints a List
    path = tmp_path / "app.yaml"
    path.write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [yaml.safe_load(VLLM), yaml.safe_load(BUDGET)]})
    )
    code, _, err = _run(capsys, "-f", str(path))
    assert code == 0
    assert "warning: PodDisruptionBudget default/vllm has no unhealthyPodEvictionPolicy: AlwaysAllow" in err


def test_a_workload_given_the_sidecar_comes_with_a_note_on_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(VLLM)
    code, _, err = _run(capsys, "-f", str(path))
    assert code == 0
    assert "note: a PodDisruptionBudget over these pods needs unhealthyPodEvictionPolicy: AlwaysAllow" in err


def test_the_command_reads_standard_input(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(VLLM))
    code, out, _ = _run(capsys, "-f", "-")
    assert code == 0
    assert out == _inject(VLLM)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("kind: [unclosed\n", "document 1 (line 1): not YAML"),
        (CONFIG_MAP + "---\n- a\n- b\n", "document 2 (line 10): not a Kubernetes object but a list"),
        ("just words\n", "document 1 (line 1): not a Kubernetes object but a str"),
        ("name: x\n", "document 1 (line 1): not a Kubernetes object (no apiVersion and kind)"),
        ("created: !!python/name:os.system\n", "document 1 (line 1): not YAML"),  # a tag safe loading refuses
        ("# nothing\n", "the input holds no Kubernetes object"),
        (VLLM.replace("      containers:\n", "      containers: oops\n      x:\n"), "containers is not a list"),
    ],
)
def test_input_that_is_not_kubernetes_yaml_exits_2_naming_the_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = _run(capsys, "-f", str(path))
    assert (code, out) == (2, "")
    assert message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--container", "nope"], "no workload has a container 'nope'"),
        (["--drain-timeout", "0"], "--drain-timeout must be above 0"),
    ],
)
def test_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    path = tmp_path / "app.yaml"
    path.write_text(VLLM)
    code, _, err = _run(capsys, "-f", str(path), *argv)
    assert code == 2
    assert message in err


def test_a_sidecar_only_engine_in_the_environment_breaks_inject_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPOTDRAIN_ENGINE", "custom")
    assert build_parser().parse_args(["sidecar"]).engine == "custom"
    path = tmp_path / "app.yaml"
    path.write_text(VLLM)
    code, _, err = _run(capsys, "-f", str(path))
    assert code == 2
    assert "--engine 'custom': choose from auto, vllm, tgi, sglang" in err


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "-f", str(tmp_path / "absent.yaml"))
    assert code == 2
    assert "cannot read" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            VLLM.replace(
                "vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.11.0\n        - name: b\n          image: vllm/x"
            ),
            "choose one with --container",
        ),
        (VLLM + "          lifecycle: {preStop: {exec: {command: [sleep, '10']}}}\n", "already has a preStop hook"),
        (VLLM.replace("containerPort: 8000", "containerPort: 8081"), "uses port 8081"),
    ],
)
def test_what_injecting_would_break_is_refused(text: str, message: str) -> None:
    with pytest.raises(InjectError, match=message):
        _inject(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (VLLM + "      volumes: 1\n", r"spec.template.spec.volumes is not a list"),
        (VLLM.replace("- containerPort: 8000", "- 8000").replace("ports:\n", "ports: 1\n"), "ports is not a list"),
    ],
)
def test_a_list_field_that_is_not_a_list_is_named_in_an_error(text: str, message: str) -> None:
    with pytest.raises(InjectError, match=message):
        _inject(text)


_KEYS = st.sampled_from(
    [
        "spec", "template", "containers", "initContainers", "name", "image", "command", "args", "ports",
        "containerPort", "lifecycle", "preStop", "volumes", "volumeMounts", "resources", "limits", "items",
        "terminationGracePeriodSeconds", "headGroupSpec", "workerGroupSpecs", "rayStartParams", "readinessGates",
    ]
)  # fmt: skip
_LEAVES = st.none() | st.booleans() | st.integers() | st.sampled_from(["vllm/vllm-openai", "sglang", "spotdrain", "1"])
_VALUES = st.recursive(_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_KEYS, inner, max_size=4))
_KINDS = st.sampled_from(["Deployment", "StatefulSet", "Pod", "RayCluster", "RayService", "List", "ConfigMap"])


@given(st.fixed_dictionaries({"apiVersion": st.just("v1"), "kind": _KINDS, "spec": _VALUES, "items": _VALUES}))
def test_no_object_makes_inject_crash(obj: Obj) -> None:
    with contextlib.suppress(InjectError):
        _inject(yaml.safe_dump(obj))


@given(st.text())
@example("a: !!python/object:os.system x\n")
@example("[" * 600)
def test_no_text_makes_inject_crash(text: str) -> None:
    with contextlib.suppress(InjectError):
        _inject(text)
