"""The PromQL that ships, checked by Prometheus' own tools: every expression in deploy/ parses (promtool check rules,
no server needed), and each alert of deploy/components/alerts fires on what it is for (promtool test rules)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import DASHBOARD, one, render, schema_errors

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package; .ci/run installs it)"
)
HERE = Path(__file__).resolve().parent
# Grafana's variables, as a query sent to Prometheus has them replaced.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def _exprs(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "expr" and isinstance(item, str):
                yield item
            else:
                yield from _exprs(item)
    elif isinstance(value, list):
        for item in value:
            yield from _exprs(item)


def dashboard_queries() -> list[str]:
    queries = list(_exprs(json.loads(DASHBOARD.read_text())))
    for variable, value in GRAFANA_VARIABLES.items():
        queries = [query.replace(variable, value) for query in queries]
    return queries


def keda_queries() -> list[str]:
    scaled = one(render("deploy/components/keda"), "ScaledObject", "vllm")
    return [t["metadata"]["query"] for t in scaled["spec"]["triggers"] if t["type"] == "prometheus"]


def alert_rules() -> dict[str, Any]:
    """The rendered PrometheusRule's groups, as a Prometheus rules file."""
    return {"groups": one(render("deploy/components/alerts"), "PrometheusRule", "spotdrain")["spec"]["groups"]}


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def check_rules(queries: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check rules`` on a file with one recording rule per query: it parses each, with no server."""
    rules = [{"record": f"spotdrain:check_{i}", "expr": query} for i, query in enumerate(queries)]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "queries", "rules": rules}]}))
    return promtool("check", "rules", "queries.yaml", cwd=tmp_path)


def test_every_promql_expression_in_deploy_parses(tmp_path: Path) -> None:
    dashboard, keda = dashboard_queries(), keda_queries()
    alerts = [rule["expr"] for group in alert_rules()["groups"] for rule in group["rules"]]
    assert (len(dashboard) > 20, len(keda), len(alerts) > 5) == (True, 2, True)
    done = check_rules([*dashboard, *keda, *alerts], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_query_that_does_not_parse_is_refused(tmp_path: Path) -> None:
    done = check_rules(["sum by (le (rate(spotdrain_drain_duration_seconds_bucket[1m]))"], tmp_path)
    assert done.returncode != 0


def test_the_alerts_fire_on_what_they_are_for_and_stay_quiet_otherwise(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(alert_rules()))
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    assert promtool("check", "rules", "rules.yaml", cwd=tmp_path).returncode == 0
    done = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_tested() -> None:
    shipped = {rule["alert"] for group in alert_rules()["groups"] for rule in group["rules"]}
    tests = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert fired == shipped


def test_a_misspelt_rule_field_is_refused_by_the_rule_schema() -> None:
    rule = copy.deepcopy(one(render("deploy/components/alerts"), "PrometheusRule", "spotdrain"))
    assert schema_errors(rule) == []
    rule["spec"]["groups"][0]["rules"][0]["expression"] = rule["spec"]["groups"][0]["rules"][0].pop("expr")
    assert schema_errors(rule) != []
