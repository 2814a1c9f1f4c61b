"""The CloudFormation template for queue mode: cfn-lint clean, and wired to what the agent parses and calls."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.notices.messages import DETAIL_TYPES, STOPPING_STATES, TERMINATING_STATES
from tests.deploy.manifests import DEPLOY, ROOT

TEMPLATE = DEPLOY / "aws" / "queue.yaml"


class _CloudFormationLoader(yaml.SafeLoader):
    """Reads the short forms (!Ref, !GetAtt, !Sub) as plain values."""


def _tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return {suffix: loader.construct_scalar(node)}
    if isinstance(node, yaml.SequenceNode):
        return {suffix: loader.construct_sequence(node)}
    return {suffix: loader.construct_mapping(node)}  # type: ignore[arg-type]


_CloudFormationLoader.add_multi_constructor("!", _tag)


def _template() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.load(TEMPLATE.read_text(), Loader=_CloudFormationLoader)
    return loaded


def _resources(kind: str) -> dict[str, Any]:
    return {name: r for name, r in _template()["Resources"].items() if r["Type"] == kind}


def _cfn_lint() -> list[str]:
    local = Path(sys.executable).parent / "cfn-lint"
    if local.exists():
        return [str(local)]
    if shutil.which("cfn-lint"):
        return ["cfn-lint"]
    pytest.importorskip("cfnlint", reason="cfn-lint is not installed")
    return [sys.executable, "-m", "cfnlint"]


def test_cfn_lint_passes() -> None:
    done = subprocess.run(
        [*_cfn_lint(), str(TEMPLATE)], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
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
