"""deploy/kuberay's Serve config, as ``kubectl kustomize`` renders it, read by the Ray the RayCluster names (2.49.0,
the Ray venv of ``simulate.ray``): the file as ``serve deploy`` parses it (``ServeDeploySchema``) and each
``ray.serve.llm:build_openai_app`` application's args as that builder validates them (``LLMServingArgs``, whose
``LLMConfig`` forbids keys it does not know).

``ray.serve.llm`` imports vLLM, which the venv leaves out (GPU-sized), so the models are taken from where Ray 2.49.0
defines them, ``ray.llm._internal.serve.configs.server_models``, once the source of ``ray.serve.llm`` shows its own
``LLMConfig`` and ``LLMServingArgs`` are subclasses of those that add nothing."""

from __future__ import annotations

import functools
import json
import subprocess
from typing import Any

import pytest
import yaml

from simulate.ray.server import LLM_MODELS, VERSION, venv_dir
from simulate.ray.server import available as ray_available
from simulate.venvs import python_of
from tests.deploy.manifests import Obj, named, one, pod_templates, render

BUILDER = "ray.serve.llm:build_openai_app"
CHECK_TIMEOUT_S = 60.0
# Run by the Ray venv's python: a serve config on stdin, what Ray made of it as JSON on stdout.
CHECK = f"""
import ast, importlib.util, json, pathlib, sys, yaml
from ray.serve.schema import ServeDeploySchema
from {LLM_MODELS} import LLMServingArgs

def adds_nothing(name):
    # ray.serve.llm's `class NAME(_NAME)` has only a docstring and `pass`, _NAME imported from where Ray defines it.
    tree = ast.parse(pathlib.Path(importlib.util.find_spec("ray.serve.llm").origin).read_text())
    imported = {{
        alias.asname or alias.name: (node.module, alias.name)
        for node in tree.body if isinstance(node, ast.ImportFrom) for alias in node.names
    }}
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    empty = all(isinstance(s, (ast.Pass, ast.Expr)) for s in cls.body)
    bases = [imported.get(base.id) for base in cls.bases if isinstance(base, ast.Name)]
    return empty and bases == [("{LLM_MODELS}", name)]

out = {{"adds_nothing": [adds_nothing(n) for n in ("LLMConfig", "LLMServingArgs")], "errors": [], "llm_configs": []}}
try:
    applications = ServeDeploySchema.parse_obj(yaml.safe_load(sys.stdin)).applications
except ValueError as error:
    applications = []
    out["errors"].append(f"ServeDeploySchema: {{error}}")
for app in applications:
    if app.import_path != "{BUILDER}":
        out["errors"].append(f"{{app.name}}: {{app.import_path}} is not a builder this check knows")
        continue
    try:
        llm_configs = LLMServingArgs.model_validate(app.args).parse_args().llm_configs
    except ValueError as error:
        out["errors"].append(f"{{app.name}}: {{error}}")
        continue
    out["llm_configs"] += [config.model_dump(mode="json") for config in llm_configs]
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module", autouse=True)
def ray_installed() -> None:
    reason = ray_available()
    if reason is not None:
        pytest.skip(reason)


@functools.cache
def ray_reads(config_text: str) -> dict[str, Any]:
    """What Ray 2.49.0 makes of a serve config: its errors, and each LLM config as its models parsed it."""
    done = subprocess.run(
        [str(python_of(venv_dir())), "-c", CHECK],
        input=config_text,
        capture_output=True,
        text=True,
        timeout=CHECK_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def serve_configs() -> dict[str, str]:
    """Each file of the ConfigMaps the RayCluster's head mounts (where ``serve deploy`` is run), by key."""
    objects = render("deploy/kuberay")
    [head] = [t for t in pod_templates(objects) if t.where == "headGroupSpec"]
    names = [v["configMap"]["name"] for v in head.spec.get("volumes", []) if "configMap" in v]
    files = {key: text for name in names for key, text in one(objects, "ConfigMap", name)["data"].items()}
    assert files, "the RayCluster's head mounts no serve config"
    return files


def llm_configs_of(config: Obj) -> list[Obj]:
    return [llm for app in config["applications"] for llm in app["args"]["llm_configs"]]


def test_ray_serve_llm_adds_nothing_to_the_models_the_config_is_checked_with() -> None:
    [text, *_] = serve_configs().values()
    assert ray_reads(text)["adds_nothing"] == [True, True]


def test_the_raycluster_names_the_ray_the_config_is_checked_with() -> None:
    [cluster] = named(render("deploy/kuberay"), "RayCluster")
    assert cluster["spec"]["rayVersion"] == VERSION
    for template in pod_templates([cluster]):
        for container in template.containers:
            if container["image"].startswith("rayproject/"):
                assert container["image"].partition(":")[2].startswith(f"{VERSION}-"), template.name


def test_the_shipped_serve_config_is_valid_for_ray_2_49s_serve_and_llm_models() -> None:
    for key, text in serve_configs().items():
        errors = ray_reads(text)["errors"]
        assert not errors, "\n".join([key, *errors])


def test_ray_2_49_reads_half_a_gpu_a_replica_and_vllms_metrics_switched_on() -> None:
    for key, text in serve_configs().items():
        parsed = ray_reads(text)["llm_configs"]
        assert parsed, key
        for llm in parsed:
            # One bundle per vLLM worker (tensor x pipeline parallel, 1 here) beside the replica's own CPU bundle.
            assert llm["resources_per_bundle"] == {"GPU": 0.5}, key
            assert llm["log_engine_metrics"] is True, key


def test_ray_2_49_refuses_the_placement_group_config_later_rays_take() -> None:
    for text in serve_configs().values():
        config = yaml.safe_load(text)
        for llm in llm_configs_of(config):
            llm["placement_group_config"] = {"bundles": [{"GPU": 0.5}]}
        errors = ray_reads(yaml.safe_dump(config))["errors"]
        assert any("placement_group_config" in e and "Extra inputs are not permitted" in e for e in errors), errors
