"""What the Prometheus of tests/install/scraping.py scraped from the install since it was applied, through the
notices, the gateway and the agent's restart: the shipped PodMonitors find the agents on the GPU nodes, the sidecars,
the engines and the gateway by service discovery, and every PromQL expression the project ships (the alerts, the
dashboard's panels, the KEDA triggers) parses and reads series that spotdrain exported during the run.

"Returns data", per expression:
- a dashboard panel's or a KEDA trigger's query, as it is sent: a range query over the run, one step per scrape
  interval, has a series; the dashboard's variables are replaced as Grafana replaces them for that range query
  (``$__range`` the range's length, ``$__interval`` its step, ``$__rate_interval`` max(``$__interval`` + the scrape
  interval, 4 times the scrape interval), Grafana's "Query variables" for Prometheus);
- an alert's expression is a condition normally false, so not the expression itself: each of its vector selectors
  has had a sample during the run (``count_over_time(SELECTOR[<the run>])``);
- and for every expression, each of its selectors so, except those of programs this install does not run
  (``ELSEWHERE``): the queue-mode agent's, the model-prefetch container's, kube-state-metrics', and the gateway's
  when none is installed. Those are matched against the series the programs' code registers at start
  (``tests.conftest.every_series``), and listed in the output.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import every_series
from tests.deploy.manifests import DASHBOARD, PodTemplate, compositions, named, pod_templates, render
from tests.deploy.test_prometheus import PROMTOOL, _exprs, alert_rules, keda_queries
from tests.install import installing
from tests.install.conftest import SPOT
from tests.install.scraping import PodFiles, Prometheus, scrape_configs, through_files

SCRAPE_S = 15  # the shipped PodMonitors' interval, kept: the run is minutes long
SCRAPED_WITHIN_S = 90.0  # from Prometheus' start: discovery, a scrape interval, and a second scrape for rate()
AGENT_JOB, ENGINE_JOB, GATEWAY_JOB = "spotdrain/spotdrain-node", "inference/vllm", "inference/spotdrain-gateway"
GATEWAY = "app.kubernetes.io/name=spotdrain-gateway"
# What exports a series this install does not scrape: its selectors are checked against the code's registries.
ELSEWHERE = {
    "spotdrain_sqs_": "the agent in queue mode (daemonset/queue-mode); the install runs daemonset/imds-mode",
    "spotdrain_check_": "the queue-mode agent's --check-interval (daemonset/queue-mode)",
    "spotdrain_model_prefetch_": "the model-prefetch container (deploy/components/model-prefetch), not installed",
    "kube_": "kube-state-metrics, which kube-prometheus-stack installs and this cluster does not run",
}
NOT_INSTALLED_GATEWAY = {"spotdrain_gateway_": "the gateway (deploy/gateway), not installed in this run"}
TARGET_LABELS = {"namespace", "pod", "container", "job", "endpoint", "instance"}  # added by the scrape, not the code
TOKEN = re.compile(r""""(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|\{[^}]*\}|\[[^\]]*\]|\d[\w.]*|[A-Za-z_:][\w:]*|\S""")
NAME = re.compile(r"[A-Za-z_:][\w:]*")
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk"}
KEYWORDS = LABEL_LISTS | AGGREGATIONS | {"quantile", "and", "or", "unless", "bool", "offset", "atan2"}
MATCHER = re.compile(r'\s*([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*,?')


def selectors(expression: str) -> list[str]:
    """The vector selectors of a PromQL expression, ``name{matchers}``, without their ranges: each name that is not
    a function, an aggregation, a keyword or in a ``by``/``on``/... label list."""
    tokens, found, index = TOKEN.findall(expression), [], 0
    while index < len(tokens):
        token, following = tokens[index], (tokens[index + 1] if index + 1 < len(tokens) else "")
        if token in LABEL_LISTS and following == "(":
            index = tokens.index(")", index)
        elif NAME.fullmatch(token) and token not in KEYWORDS and following != "(":
            found.append(token + (following if following.startswith("{") else ""))
        index += 1
    return found


def grafana(query: str, *, range_s: int, step_s: int) -> str:
    """``query`` with the variables Grafana replaces in a range query of ``range_s`` at ``step_s``."""
    values = {"__range": f"{range_s}s", "__interval": f"{step_s}s"}
    values["__rate_interval"] = f"{max(step_s + SCRAPE_S, 4 * SCRAPE_S)}s"
    sent = re.sub(r"\$(\w+)", lambda found: values.get(found.group(1), found.group(0)), query)
    assert "$" not in sent, f"a variable this test does not know how Grafana replaces: {query}"
    return sent


def elsewhere(selector: str, gateway: bool) -> str | None:
    """Why this install exports no series for ``selector``, or None where it should have."""
    where = ELSEWHERE if gateway else ELSEWHERE | NOT_INSTALLED_GATEWAY
    return next((why for prefix, why in where.items() if selector.startswith(prefix)), None)


def registered(selector: str) -> bool:
    """Whether a series the programs register at start matches ``selector`` (labels the scrape adds aside)."""
    name, _, rest = selector.partition("{")
    matchers = [m for m in MATCHER.findall(rest.rstrip("}")) if m[0] not in TARGET_LABELS]
    for family in every_series().collect():
        for sample in family.samples:
            if sample.name == name and all(_matches(sample.labels.get(k, ""), op, v) for k, op, v in matchers):
                return True
    return False


def _matches(value: str, operator: str, wanted: str) -> bool:
    equal = re.fullmatch(wanted, value) is not None if "~" in operator else value == wanted
    return equal != operator.startswith("!")


class Check:
    """The problems found in the shipped expressions against what ``prometheus`` scraped from ``start`` to ``end``."""

    def __init__(self, prometheus: Prometheus, start: float, end: float, gateway: bool) -> None:
        self.prometheus, self.start, self.end, self.gateway = prometheus, start, end, gateway
        self.problems: list[tuple[str, str]] = []  # (what, the problem)
        self.elsewhere: dict[str, str] = {}

    def expression(self, what: str, expression: str, *, as_sent: bool) -> None:
        try:
            self.prometheus.query(expression)
        except AssertionError as error:  # a query that does not parse: 400 bad_data
            self.problems.append((what, f"does not parse: {error}"))
            return
        found = selectors(expression)
        if not found:
            self.problems.append((what, f"no vector selector found in {expression!r}"))
        live = [selector for selector in found if self.selector(what, selector)]
        if as_sent and live == found and found:
            try:
                series = self.prometheus.query_range(expression, self.start, self.end, SCRAPE_S)
            except AssertionError as error:  # one that fails on the data, e.g. a many-to-many match
                self.problems.append((what, f"fails over the run: {error}"))
                return
            if not series:
                self.problems.append((what, f"returned no data over the run: {expression}"))

    def selector(self, what: str, selector: str) -> bool:
        """Check one selector; whether it was checked against the scraped series."""
        why = elsewhere(selector, self.gateway)
        if why is not None:
            self.elsewhere[selector] = why
            if not selector.startswith("kube_") and not registered(selector):
                self.problems.append((what, f"{selector} matches no series the programs export"))
            return False
        window = int(self.end - self.start) + 1
        if not self.prometheus.query(f"count_over_time({selector}[{window}s])"):
            self.problems.append((what, f"{selector} had no sample during the run"))
        return True


def shipped(range_s: int) -> Iterable[tuple[str, str, bool]]:
    """(what, expression, whether it is sent as it is) for every alert, dashboard panel and KEDA trigger."""
    for group in alert_rules()["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule['alert']}", rule["expr"], False
    for number, query in enumerate(_exprs(json.loads(DASHBOARD.read_text())), 1):
        yield f"dashboard query {number}", grafana(query, range_s=range_s, step_s=SCRAPE_S), True
    for number, query in enumerate(keda_queries(), 1):
        yield f"KEDA trigger {number}", query, True


def gateway_installed(installed: installing.Installed) -> bool:
    return bool(installed.cluster.get("deployments", "-A", "-l", GATEWAY)["items"])


def ever_up(prometheus: Prometheus, job: str) -> list[dict[str, str]]:
    """The targets of ``job`` scraped successfully at least once since Prometheus started, their labels."""
    window = int(time.time() - prometheus.started) + 1
    found = prometheus.query(f'max_over_time(up{{job="{job}"}}[{window}s]) == 1')
    return [series["metric"] for series in found]


def wait_scraped(prometheus: Prometheus, job: str, enough: Any) -> list[dict[str, str]]:
    """``ever_up(job)`` once ``enough`` of it holds (and a second scrape since, for rates); the last seen if never."""
    give_up = prometheus.started + SCRAPED_WITHIN_S
    while not enough(targets := ever_up(prometheus, job)) and time.time() < give_up:
        time.sleep(1)
    return targets


def test_the_podmonitors_find_the_agents_and_the_engines_with_their_sidecars(
    installed: installing.Installed, prometheus: Prometheus
) -> None:
    began, cluster = time.monotonic(), installed.cluster
    # The DaemonSet runs on GPU nodes only (its node affinity), with the host's network: its pods' addresses are
    # those of the nodes it runs on, the Spot node among them.
    pods = cluster.get("pods", "-n", "spotdrain", "-l", "app.kubernetes.io/name=spotdrain-node")["items"]
    nodes = {pod["status"].get("hostIP") for pod in pods}
    assert cluster.node(SPOT.name).address in nodes, pods

    def hosts(targets: list[dict[str, str]]) -> set[str]:
        return {target["instance"].rpartition(":")[0] for target in targets}

    agents = wait_scraped(prometheus, AGENT_JOB, lambda found: hosts(found) >= nodes)
    print(f"\n[metrics] {time.monotonic() - began:5.2f} s  agents scraped at {sorted(hosts(agents))}")
    engines = wait_scraped(
        prometheus, ENGINE_JOB, lambda found: {"http", "spotdrain"} <= {t["endpoint"] for t in found}
    )
    print(f"[metrics] {time.monotonic() - began:5.2f} s  vllm pods' targets scraped: {len(engines)}")
    assert hosts(agents) == nodes, (agents, prometheus.targets())
    assert {(t["namespace"], t["container"], t["endpoint"]) for t in agents} == {("spotdrain", "agent", "metrics")}
    by_pod: dict[str, set[tuple[str, str]]] = {}
    for target in engines:
        by_pod.setdefault(target["pod"], set()).add((target["container"], target["endpoint"]))
    pair = {("vllm", "http"), ("spotdrain", "spotdrain")}  # the engine, and the sidecar beside it
    for pod, seen in by_pod.items():
        assert pod.startswith("vllm-"), by_pod
        assert seen <= pair, (pod, seen)
    # A pod may live less than a scrape interval from its discovery (the notice's, when it comes just after the
    # install): some of its targets then are never scraped. Those of a pod that lived longer all are.
    assert [pod for pod, seen in by_pod.items() if seen == pair], (by_pod, prometheus.targets())


def test_the_podmonitor_finds_the_gateway(installed: installing.Installed, prometheus: Prometheus) -> None:
    if not gateway_installed(installed):
        pytest.skip("no gateway is installed in this run (test_gateway.py installs deploy/gateway)")
    gateways = wait_scraped(prometheus, GATEWAY_JOB, bool)
    assert gateways, prometheus.targets()
    assert {(t["container"], t["endpoint"]) for t in gateways} == {("gateway", "metrics")}, gateways


def test_every_shipped_expression_parses_and_reads_series_scraped_during_the_run(
    installed: installing.Installed, prometheus: Prometheus
) -> None:
    began = time.monotonic()
    twice = f'count_over_time(up{{job="{AGENT_JOB}"}}[{SCRAPED_WITHIN_S:.0f}s]) >= 2'  # what a rate() needs
    while not prometheus.query(twice) and time.time() < prometheus.started + SCRAPED_WITHIN_S:
        time.sleep(1)
    end = time.time()
    check = Check(prometheus, prometheus.started, end, gateway_installed(installed))
    expressions = list(shipped(int(end - prometheus.started) + 1))
    for what, expression, as_sent in expressions:
        check.expression(what, expression, as_sent=as_sent)
    print(f"\n[metrics] {time.monotonic() - began:5.2f} s  {len(expressions)} expressions checked")
    for selector, why in sorted(check.elsewhere.items()):
        print(f"[metrics] not scraped here, matched against the code's series: {selector} ({why})")
    assert len(expressions) > 30, expressions
    assert check.problems == [], "\n".join(f"{what}: {it}" for what, it in check.problems)


def test_a_misspelt_metric_or_a_broken_expression_is_reported(
    installed: installing.Installed, prometheus: Prometheus
) -> None:
    check = Check(prometheus, prometheus.started, time.time(), gateway_installed(installed))
    check.expression("misspelt", "sum(increase(spotdrain_evictions_totl[5m]))", as_sent=True)
    check.expression("misspelt elsewhere", "sum(spotdrain_sqs_mesages_total)", as_sent=True)
    check.expression("unknown label value", 'sum(spotdrain_evictions_total{result="gaveup"})', as_sent=True)
    check.expression("broken", "sum by (le (rate(spotdrain_drain_duration_seconds_bucket[1m]))", as_sent=True)
    assert {what for what, _ in check.problems} == {"misspelt", "misspelt elsewhere", "unknown label value", "broken"}
    assert next(it for what, it in check.problems if what == "broken").startswith("does not parse"), check.problems


def template_pod(template: PodTemplate, number: int) -> dict[str, Any]:
    """A running pod as the API server would list it, made from a rendered pod template (its controller adds only
    what the PodMonitors do not read: a name's suffix, a uid, more labels for some)."""
    metadata: dict[str, Any] = {"name": f"{template.owner['metadata']['name']}-{number}"}
    metadata["namespace"] = template.namespace
    metadata |= {"labels": dict(template.labels), "annotations": dict(template.annotations)}
    status = {"podIP": f"10.0.0.{number}", "hostIP": "10.0.0.254", "phase": "Running"}
    return {"metadata": metadata, "spec": template.spec, "status": status}


def kept(directory: Path, job: Mapping[str, Any]) -> list[dict[str, str]]:
    """The targets that ``promtool check service-discovery`` (Prometheus' discovery and relabelling) keeps for
    ``job``: their labels after relabelling."""
    assert PROMTOOL is not None
    config = directory / (re.sub(r"\W", "_", job["job_name"]) + ".yml")
    config.write_text(json.dumps({"scrape_configs": [job]}))
    argv = [PROMTOOL, "check", "service-discovery", "--timeout=1s", str(config), job["job_name"]]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    found, _ = json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("[") :])
    return [target["labels"] for target in found if target["labels"]]


def test_every_podmonitor_keeps_a_target_per_endpoint_of_the_workloads_it_ships_with(tmp_path: Path) -> None:
    """Rendered, where the installed ones above are scraped: in each composition a PodMonitor ships in (tests/deploy's
    compositions: each mode overlay, the component it watches, deploy/gateway, deploy/kuberay), each of its
    endpoints keeps a target of the pods the composition's templates make, as Prometheus relabels them. A
    PodMonitor whose port name is wrong keeps none."""
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian's prometheus package; .ci/run installs it)")
    jobs: list[tuple[str, dict[str, Any]]] = []
    for number, what in enumerate(c for c in compositions() if "/podmonitors/" in c):
        objects, files = render(what), PodFiles(tmp_path / f"composition-{number}")
        files.directory.mkdir()
        namespaces: set[str] = set()
        for monitor in named(objects, "PodMonitor"):
            wrong = json.loads(json.dumps(monitor))
            wrong["metadata"]["name"] += "-wrong-port"
            wrong["spec"]["podMetricsEndpoints"][0]["port"] += "x"
            for config in [*scrape_configs(monitor, tmp_path), scrape_configs(wrong, tmp_path)[0]]:
                replaced, names = through_files(config, files)
                jobs.append((what, replaced | {"job_name": f"{number}/{replaced['job_name']}"}))
                namespaces |= names
        files.write([template_pod(t, n) for n, t in enumerate(pod_templates(objects), 1)], namespaces)
    with ThreadPoolExecutor(8) as pool:  # each call waits out its --timeout
        found = list(pool.map(lambda job: kept(tmp_path, job[1]), jobs))
    empty = {(what, job["job_name"]) for (what, job), targets in zip(jobs, found, strict=True) if not targets}
    wrong = {(what, job["job_name"]) for what, job in jobs if "-wrong-port/" in job["job_name"]}
    assert len(jobs) > 2 * len(wrong) > 0, jobs
    assert empty == wrong, (empty - wrong, wrong - empty)
