"""The CloudFormation templates: cfn-lint clean, and wired to what the programs parse and call. Queue mode's queue,
rules and policy; the model cache's read policy and its IRSA roles, evaluated the way CloudFormation would."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from agent.cache.fetch.run import fetch
from agent.cache.fetch.settings import FetchSettings
from agent.cache.fetch.sources import S3Source
from agent.notices.messages import DETAIL_TYPES, STOPPING_STATES, TERMINATING_STATES
from tests.conftest import serving_app
from tests.deploy.manifests import DEPLOY, ROOT, Obj

TEMPLATE = DEPLOY / "aws" / "queue.yaml"
MODEL_CACHE = DEPLOY / "aws" / "model-cache.yaml"
TEMPLATES = sorted((DEPLOY / "aws").glob("*.yaml"))


class _CloudFormationLoader(yaml.SafeLoader):
    """Reads the short forms (!Ref, !GetAtt, !Sub) as plain values."""


def _tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return {suffix: loader.construct_scalar(node)}
    if isinstance(node, yaml.SequenceNode):
        return {suffix: loader.construct_sequence(node)}
    return {suffix: loader.construct_mapping(node)}  # type: ignore[arg-type]


_CloudFormationLoader.add_multi_constructor("!", _tag)


def _template(path: Path = TEMPLATE) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(path.read_text(), Loader=_CloudFormationLoader)
    return loaded


def _resources(kind: str, path: Path = TEMPLATE) -> dict[str, Any]:
    return {name: r for name, r in _template(path)["Resources"].items() if r["Type"] == kind}


def _cfn_lint() -> list[str]:
    local = Path(sys.executable).parent / "cfn-lint"
    if local.exists():
        return [str(local)]
    if shutil.which("cfn-lint"):
        return ["cfn-lint"]
    pytest.importorskip("cfnlint", reason="cfn-lint is not installed")
    return [sys.executable, "-m", "cfnlint"]


def test_every_template_is_one_of_these() -> None:
    assert sorted([TEMPLATE, MODEL_CACHE]) == TEMPLATES


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_cfn_lint_passes(template: Path) -> None:
    done = subprocess.run(
        [*_cfn_lint(), str(template)], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_queue_is_encrypted_keeps_messages_five_minutes_and_exports_its_url_and_arn() -> None:
    (queue,) = _resources("AWS::SQS::Queue").values()
    assert queue["Properties"]["MessageRetentionPeriod"] == 300
    assert queue["Properties"]["SqsManagedSseEnabled"] is True
    assert {"QueueURL", "QueueARN"} <= set(_template()["Outputs"])


def test_only_eventbridge_may_send_and_only_from_these_rules() -> None:
    (policy,) = _resources("AWS::SQS::QueuePolicy").values()
    statements = policy["Properties"]["PolicyDocument"]["Statement"]
    allows = [s for s in statements if s["Effect"] == "Allow"]
    assert [(s["Principal"], s["Action"]) for s in allows] == [({"Service": "events.amazonaws.com"}, "sqs:SendMessage")]
    sources = {ref["GetAtt"].split(".")[0] for ref in allows[0]["Condition"]["ArnEquals"]["aws:SourceArn"]}
    assert sources == set(_resources("AWS::Events::Rule"))


def test_every_rule_sends_an_event_the_agent_parses() -> None:
    patterns = [rule["Properties"]["EventPattern"] for rule in _resources("AWS::Events::Rule").values()]
    detail_types = {t for p in patterns for t in p["detail-type"]}
    assert detail_types == DETAIL_TYPES - {"EC2 Instance-launch Lifecycle Action"}
    states = next(p["detail"]["state"] for p in patterns if "state" in p.get("detail", {}))
    assert set(states) == STOPPING_STATES | TERMINATING_STATES
    health = next(p for p in patterns if p["source"] == ["aws.health"])
    assert health["detail"] == {"service": ["EC2"], "eventTypeCategory": ["scheduledChange"]}
    for rule in _resources("AWS::Events::Rule").values():
        assert rule["Properties"]["Targets"][0]["Arn"] == {"GetAtt": "InterruptionQueue.Arn"}


def test_the_agents_policy_allows_exactly_the_aws_calls_it_makes() -> None:
    source = (ROOT / "agent" / "notices" / "sqs_calls.py").read_text()
    calls = set(re.findall(r"self\.(sqs|autoscaling)\.(\w+)\(", source))
    wanted = {f"{service}:{''.join(part.title() for part in method.split('_'))}" for service, method in calls}
    (policy,) = _resources("AWS::IAM::ManagedPolicy").values()
    granted = {action for s in policy["Properties"]["PolicyDocument"]["Statement"] for action in s["Action"]}
    assert granted == wanted


# The model cache ---------------------------------------------------------------------------------------------------

PSEUDO = {"AWS::Partition": "aws", "AWS::Region": "us-east-1", "AWS::AccountId": "111122223333"}
OIDC = "oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE"
KMS_KEY = "arn:aws:kms:us-east-1:111122223333:key/1234abcd-12ab-34cd-56ef-1234567890ab"
_NO_VALUE = object()
# What each S3 call of the fetch needs (https://docs.aws.amazon.com/AmazonS3/latest/API/API_HeadObject.html: "you
# must have the s3:GetObject permission"; ListObjectsV2: s3:ListBucket; a presigned GET acts as its signer).
# What each S3 operation needs (https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html and the
# HeadObject and GetObject pages: HEAD and GET of an object both need s3:GetObject).
S3_PERMISSIONS = {"ListObjectsV2": "s3:ListBucket", "HeadObject": "s3:GetObject", "GetObject": "s3:GetObject"}


@dataclass(frozen=True)
class Stack:
    """The model-cache template under given parameters: its conditions, and values resolved as CloudFormation does
    (Ref, Sub, Join, If, Not, Equals; a resource's Ref is left as it is)."""

    template: dict[str, Any]
    parameters: dict[str, Any]

    @classmethod
    def of(cls, **given: str) -> Stack:
        template = _template(MODEL_CACHE)
        parameters: dict[str, Any] = {}
        for name, spec in template["Parameters"].items():
            value = given.get(name, spec.get("Default"))
            assert value is not None, f"parameter {name} has no default: give it"
            parameters[name] = value.split(",") if spec["Type"] == "CommaDelimitedList" else value
        return cls(template, parameters)

    def condition(self, name: str) -> bool:
        return bool(self.value(self.template["Conditions"][name]))

    def resources(self, kind: str) -> dict[str, Any]:
        return {
            name: self.value(r["Properties"])
            for name, r in self.template["Resources"].items()
            if r["Type"] == kind and ("Condition" not in r or self.condition(r["Condition"]))
        }

    def value(self, node: Any) -> Any:
        if isinstance(node, list):
            return [v for v in (self.value(item) for item in node) if v is not _NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            [(function, argument)] = node.items()
            if function == "Ref":
                if argument == "AWS::NoValue":
                    return _NO_VALUE
                return {**PSEUDO, **self.parameters}.get(argument, node)
            if function == "Sub":
                text, names = argument if isinstance(argument, list) else (argument, {})
                known = {**PSEUDO, **self.parameters, **self.value(names)}
                return re.sub(r"\$\{([\w:]+)\}", lambda m: str(known[m.group(1)]), text)
            if function == "Join":
                return argument[0].join(self.value(argument[1]))
            if function == "If":
                return self.value(argument[1] if self.condition(argument[0]) else argument[2])
            if function == "Not":
                return not self.value(argument[0])
            if function == "Equals":
                return self.value(argument[0]) == self.value(argument[1])
        return {k: v for k, v in ((k, self.value(v)) for k, v in node.items()) if v is not _NO_VALUE}


def _granted(stack: Stack) -> set[tuple[str, str, str]]:
    """(action, resource, condition as JSON) for every statement of the read policy."""
    [policy] = stack.resources("AWS::IAM::ManagedPolicy").values()
    found = set()
    for statement in policy["PolicyDocument"]["Statement"]:
        assert statement["Effect"] == "Allow"
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        for action in actions:
            found.add((action, statement["Resource"], json.dumps(statement.get("Condition"), sort_keys=True)))
    return found


def test_the_model_policy_reads_exactly_the_prefix_and_lists_nothing_else() -> None:
    assert _granted(Stack.of(ModelBucket="my-bucket")) == {
        ("s3:GetObject", "arn:aws:s3:::my-bucket/models/*", "null"),
        ("s3:ListBucket", "arn:aws:s3:::my-bucket", json.dumps({"StringLike": {"s3:prefix": "models/*"}})),
    }


def test_a_kms_key_adds_decrypt_on_that_key_alone() -> None:
    plain = _granted(Stack.of(ModelBucket="my-bucket", ModelPrefix="llm/"))
    with_key = _granted(Stack.of(ModelBucket="my-bucket", ModelPrefix="llm/", ModelKmsKeyArn=KMS_KEY))
    assert with_key - plain == {("kms:Decrypt", KMS_KEY, "null")}
    assert ("s3:GetObject", "arn:aws:s3:::my-bucket/llm/*", "null") in plain


async def test_the_model_policy_allows_exactly_the_s3_calls_the_fetch_makes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole fetch against an S3 that records each operation it is asked for, by its method and target."""
    data, seen = b"weights!", set()

    async def s3(request: web.Request) -> web.Response:
        bucket_only = request.path.rstrip("/") == "/my-bucket"
        if bucket_only and request.query.get("list-type") == "2":
            seen.add("ListObjectsV2")
            item = f'<Key>llm/m/w.bin</Key><Size>{len(data)}</Size><ETag>"{hashlib.md5(data).hexdigest()}"</ETag>'
            return web.Response(body=f"<ListBucketResult><Contents>{item}</Contents></ListBucketResult>")
        operation = {"HEAD": "HeadObject", "GET": "GetObject"}.get(request.method, request.method)
        seen.add(operation if not bucket_only else f"{request.method} of the bucket")
        return web.Response(body=data if request.method == "GET" else None, headers={"Content-Length": str(len(data))})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", s3)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    async with serving_app(app) as port:
        settings = FetchSettings(
            source=S3Source("my-bucket", "llm/m/"),
            name="m",
            cache_path=tmp_path,
            aws_endpoint_url=f"http://127.0.0.1:{port}",
            aws_region="us-east-1",
            concurrency=2,
            part_size_bytes=1024 * 1024,
            wait=False,
            request_timeout_s=5.0,
            progress_interval_s=5.0,
        )
        assert (await fetch(settings) / "w.bin").read_bytes() == data
    assert seen <= set(S3_PERMISSIONS), "a new S3 call: add what it needs to S3_PERMISSIONS and the policy"
    granted = {action for action, _, _ in _granted(Stack.of(ModelBucket="my-bucket"))}
    assert granted == {S3_PERMISSIONS[operation] for operation in seen}


def _trust(role: Obj) -> Obj:
    document: Obj = json.loads(role["AssumeRolePolicyDocument"])
    statement: Obj
    [statement] = document["Statement"]
    return statement


def test_each_role_trusts_only_its_service_accounts_through_the_clusters_oidc_provider() -> None:
    stack = Stack.of(ModelBucket="my-bucket", OidcProvider=OIDC)
    roles = stack.resources("AWS::IAM::Role")
    assert set(roles) == {"AgentRole", "InferenceRole"}
    subjects = {}
    for name, role in roles.items():
        assert role["ManagedPolicyArns"] == [{"Ref": "ModelReadPolicy"}]
        statement = _trust(role)
        assert statement["Effect"] == "Allow"
        assert statement["Principal"] == {"Federated": f"arn:aws:iam::111122223333:oidc-provider/{OIDC}"}
        assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
        assert set(statement["Condition"]) == {"StringEquals"}
        condition = statement["Condition"]["StringEquals"]
        assert condition[f"{OIDC}:aud"] == "sts.amazonaws.com"
        assert set(condition) == {f"{OIDC}:aud", f"{OIDC}:sub"}
        subjects[name] = condition[f"{OIDC}:sub"]
    assert subjects == {
        "AgentRole": ["system:serviceaccount:spotdrain:spotdrain-node"],
        "InferenceRole": ["system:serviceaccount:inference:vllm", "system:serviceaccount:ray:ray-llm-worker"],
    }
    outputs = stack.template["Outputs"]
    assert {outputs[name]["Value"]["GetAtt"] for name in ("AgentRoleArn", "InferenceRoleArn")} == {
        "AgentRole.Arn",
        "InferenceRole.Arn",
    }


def test_without_an_oidc_provider_the_stack_makes_the_policy_alone() -> None:
    stack = Stack.of(ModelBucket="my-bucket")
    assert stack.resources("AWS::IAM::Role") == {}
    assert list(stack.resources("AWS::IAM::ManagedPolicy")) == ["ModelReadPolicy"]
    outputs = stack.template["Outputs"]
    assert [name for name, output in outputs.items() if "Condition" not in output] == ["ModelReadPolicyArn"]
