"""Prometheus (Debian's ``/usr/bin/prometheus``) on the host, scraping the installed spotdrain as a user's Prometheus
Operator would have it scrape: one scrape config per endpoint of each shipped PodMonitor
(``deploy/components/podmonitors``), made as the operator makes it, its targets the real API server's pods as
Kubernetes service discovery (role ``pod``) gives them; the host reaches the pods' addresses through its routes.

Debian builds Prometheus without Kubernetes service discovery ("Kubernetes support has been completely removed",
/usr/share/doc/prometheus/NEWS.Debian.gz, 1.5.0+ds-1; ``promtool check config`` refuses ``kubernetes_sd_configs``).
So ``PodDiscovery`` lists the API server's pods and writes, for each namespace, the targets with the meta labels
Prometheus' own role ``pod`` gives them, into files that a ``file_sd_configs`` entry reads in place of each
``kubernetes_sd_configs`` entry; the operator's relabelings then select among them unchanged.

``start(kubeconfig, directory)`` returns a running ``Prometheus`` (its data in ``directory``) whose ``query``,
``query_range`` and ``targets`` ask its HTTP API; ``stop()`` ends it. Where Debian's prometheus is not installed,
``start`` raises ``Unavailable`` with the reason, and the tests that need it skip.
"""

from __future__ import annotations

import json
import re
import shutil
import ssl
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from simulate.fakes.processes import free_port
from tests.deploy.manifests import DEPLOY, named, render
from tests.install import sweep

PODMONITORS = DEPLOY / "components" / "podmonitors"
READY_WITHIN_S = 30.0
TIMEOUT_S = 10.0
POLL_S = 1.0
# The fields the translation below knows; a PodMonitor using any other fails the translation rather than being
# scraped other than the operator would scrape it.
SPEC_FIELDS = {"selector", "namespaceSelector", "podMetricsEndpoints", "jobLabel", "podTargetLabels"}
ENDPOINT_FIELDS = {"port", "portNumber", "path", "interval", "scrapeTimeout", "scheme", "params", "honorLabels"}
ENDPOINT_FIELDS |= {"honorTimestamps", "filterRunning", "relabelings", "metricRelabelings"}


def podmonitors() -> list[dict[str, Any]]:
    """Every shipped PodMonitor, as ``kubectl kustomize`` renders each component under deploy/components/podmonitors."""
    components = sorted(path for path in PODMONITORS.iterdir() if (path / "kustomization.yaml").is_file())
    return [
        monitor for path in components for monitor in named(render(str(path.relative_to(DEPLOY.parent))), "PodMonitor")
    ]


# The translation. prometheus-operator turns a PodMonitor into Prometheus scrape configs in
# pkg/prometheus/promcfg.go, generatePodMonitorConfig (v0.93.0); these are its rules, for the default "relabel"
# selector mechanism and one shard (its sharding relabelings, hashmod 1 then keep shard 0, keep every target):
# - one job per podMetricsEndpoints entry, named podMonitor/<namespace>/<name>/<index>;
# - kubernetes_sd_configs role pod, namespaces: the namespaceSelector's matchNames, none (all) for any: true, and
#   the PodMonitor's own namespace when the selector is empty (getNamespacesFromNamespaceSelector);
# - interval, scrapeTimeout, path, scheme, params as scrape_interval, scrape_timeout, metrics_path, scheme, params;
# - relabelings: job copied to __tmp_prometheus_job_name (initRelabelings); pods in phase Failed or Succeeded dropped
#   unless filterRunning is false (generateRunningFilter); each matchLabels key kept on
#   [__meta_kubernetes_pod_label_<key>, __meta_kubernetes_pod_labelpresent_<key>] matching "(<value>);true", the
#   key's characters outside [a-zA-Z0-9_] made "_" (sanitizeLabelName), and matchExpressions In/NotIn/Exists/
#   DoesNotExist as keep/drop on the same labels; the port kept on __meta_kubernetes_pod_container_port_name (or
#   portNumber on ..._port_number); then namespace, container and pod from __meta_kubernetes_namespace,
#   ..._pod_container_name and ..._pod_name; podTargetLabels; job "<namespace>/<name>" (overridden by the pod's
#   jobLabel label when it has one); endpoint the port's name; and last the endpoint's own relabelings;
# - metricRelabelings as metric_relabel_configs; both with their fields in Prometheus' spelling and the action in
#   lower case (generateRelabelConfig).


def scrape_configs(monitor: Mapping[str, Any], kubeconfig: Path) -> list[dict[str, Any]]:
    """The scrape configs prometheus-operator makes of ``monitor``, service discovery through ``kubeconfig``."""
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    spec = monitor["spec"]
    unknown = set(spec) - SPEC_FIELDS
    assert not unknown, f"PodMonitor {namespace}/{name}: no translation here for {sorted(unknown)}"
    discovery: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    namespaces = _namespaces(spec.get("namespaceSelector", {}), namespace)
    if namespaces:
        discovery["namespaces"] = {"names": namespaces}
    configs = []
    for index, endpoint in enumerate(spec["podMetricsEndpoints"]):
        unknown = set(endpoint) - ENDPOINT_FIELDS
        assert not unknown, f"PodMonitor {namespace}/{name}: no translation here for {sorted(unknown)}"
        config: dict[str, Any] = {"job_name": f"podMonitor/{namespace}/{name}/{index}"}
        config |= {"honor_labels": endpoint.get("honorLabels", False), "kubernetes_sd_configs": [discovery]}
        if "honorTimestamps" in endpoint:
            config["honor_timestamps"] = endpoint["honorTimestamps"]
        for field, key in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout")):
            if field in endpoint:
                config[key] = endpoint[field]
        for field, key in (("path", "metrics_path"), ("scheme", "scheme"), ("params", "params")):
            if field in endpoint:
                config[key] = endpoint[field]
        config["relabel_configs"] = _relabelings(monitor, endpoint)
        if endpoint.get("metricRelabelings"):
            config["metric_relabel_configs"] = [_relabel(rule) for rule in endpoint["metricRelabelings"]]
        configs.append(config)
    return configs


def _namespaces(selector: Mapping[str, Any], own: str) -> list[str]:
    if selector.get("any"):
        return []
    return list(selector.get("matchNames") or [own])


def _label(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _relabelings(monitor: Mapping[str, Any], endpoint: Mapping[str, Any]) -> list[dict[str, Any]]:
    namespace, name = monitor["metadata"]["namespace"], monitor["metadata"]["name"]
    spec = monitor["spec"]
    rules: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    if endpoint.get("filterRunning", True):
        rules.append(
            {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"}
        )
    rules += _selector_rules(spec.get("selector", {}))
    if "port" in endpoint:
        rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"]})
        rules[-1]["regex"] = endpoint["port"]
    elif "portNumber" in endpoint:
        rules.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_number"]})
        rules[-1]["regex"] = str(endpoint["portNumber"])
    for source, target in (("namespace", "namespace"), ("pod_container_name", "container"), ("pod_name", "pod")):
        rules.append({"source_labels": [f"__meta_kubernetes_{source}"], "target_label": target})
    for label in spec.get("podTargetLabels", []):
        pod_label = [f"__meta_kubernetes_pod_label_{_label(label)}"]
        rules.append(
            {"source_labels": pod_label, "target_label": _label(label), "regex": "(.+)", "replacement": "${1}"}
        )
    rules.append({"target_label": "job", "replacement": f"{namespace}/{name}"})
    if spec.get("jobLabel"):
        job_label = [f"__meta_kubernetes_pod_label_{_label(spec['jobLabel'])}"]
        rules.append({"source_labels": job_label, "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
    if "port" in endpoint:
        rules.append({"target_label": "endpoint", "replacement": endpoint["port"]})
    return rules + [_relabel(rule) for rule in endpoint.get("relabelings", [])]


def _selector_rules(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    rules = []
    for key in sorted(selector.get("matchLabels", {})):
        sources = [f"__meta_kubernetes_pod_label_{_label(key)}", f"__meta_kubernetes_pod_labelpresent_{_label(key)}"]
        rules.append({"action": "keep", "source_labels": sources, "regex": f"({selector['matchLabels'][key]});true"})
    for expression in selector.get("matchExpressions", []):
        key, operator = _label(expression["key"]), expression["operator"]
        sources = [f"__meta_kubernetes_pod_label_{key}", f"__meta_kubernetes_pod_labelpresent_{key}"]
        values = "|".join(expression.get("values", []))
        rule = {
            "In": {"action": "keep", "source_labels": sources, "regex": f"({values});true"},
            "NotIn": {"action": "drop", "source_labels": sources, "regex": f"({values});true"},
            "Exists": {"action": "keep", "source_labels": sources[1:], "regex": "true"},
            "DoesNotExist": {"action": "drop", "source_labels": sources[1:], "regex": "true"},
        }[operator]
        rules.append(rule)
    return rules


def _relabel(rule: Mapping[str, Any]) -> dict[str, Any]:
    spelling = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    translated = {spelling.get(key, key): value for key, value in rule.items()}
    if "action" in translated:
        translated["action"] = str(translated["action"]).lower()
    return translated


class PodFiles:
    """Pods' targets as Prometheus' ``kubernetes_sd_configs`` role ``pod`` finds them, written as files for
    ``file_sd_configs``: each namespace's in ``pods-<namespace>.json`` in ``directory`` (``pods.json``: every
    namespace's), renamed into place whole, which Prometheus' file discovery picks up at once (it watches the files).

    The targets and labels are those of discovery/kubernetes/pod.go at v2.42.0, Debian's version (buildPod,
    podLabels): a pod without an IP has none; every container and init container gives one target per declared
    port, ``<pod IP>:<port>`` with ``__meta_kubernetes_pod_container_port_name``/``_number``/``_protocol``, or one at
    the pod IP alone when it declares none; each target has the pod's labels and annotations (name characters outside
    [a-zA-Z0-9_] made ``_``) with their ``..._labelpresent_``/``..._annotationpresent_`` ``true``, its name, IP,
    ready condition in lower case (``unknown`` without one), phase, node name, host IP, uid, controller's kind and
    name, the container's name, id, image and ``..._container_init``, and ``__meta_kubernetes_namespace``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.written: dict[str, str] = {}

    def file(self, namespace: str | None) -> Path:
        return self.directory / (f"pods-{namespace}.json" if namespace else "pods.json")

    def write(self, pods: Iterable[Mapping[str, Any]], namespaces: Iterable[str] = ()) -> None:
        """Write each file whose targets changed; ``namespaces`` are those to write even when they hold no pod (an
        empty file is an empty discovery)."""
        groups: dict[str | None, list[dict[str, Any]]] = {None: [], **{name: [] for name in namespaces}}
        for pod in pods:
            found = pod_targets(pod)
            groups[None] += found
            groups.setdefault(pod["metadata"]["namespace"], []).extend(found)
        for namespace, targets in groups.items():
            text = json.dumps(targets, sort_keys=True)
            if self.written.get(str(namespace)) != text:
                partial = self.directory / f".{self.file(namespace).name}.new"
                partial.write_text(text)
                partial.rename(self.file(namespace))
                self.written[str(namespace)] = text


class PodDiscovery(PodFiles):
    """``PodFiles`` of the API server's pods, listed every ``POLL_S`` in a thread once started (the real discovery
    watches; a second's lag is nothing beside a 15 s scrape interval)."""

    def __init__(self, kubeconfig: Path, directory: Path) -> None:
        super().__init__(directory)
        config = yaml.safe_load(kubeconfig.read_text())
        cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
        headers = {"Authorization": f"Bearer {user['token']}"}
        trust = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.client = httpx.Client(base_url=cluster["server"], verify=trust, headers=headers, timeout=TIMEOUT_S)
        self.errors = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="pod-discovery", daemon=True)

    def refresh(self, namespaces: Iterable[str] = ()) -> None:
        """List the pods once and write their files."""
        answer = self.client.get("/api/v1/pods")
        answer.raise_for_status()
        self.write(answer.json()["items"], namespaces)

    def _poll(self) -> None:
        """Refresh until ``stop``; a failed list (the API server stopped before the run's end) is counted and
        tried again, and the files keep the last pods seen, as the real discovery keeps its last state."""
        while not self.stopped.wait(POLL_S):
            try:
                self.refresh()
            except (httpx.HTTPError, ValueError, KeyError):
                self.errors += 1

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(TIMEOUT_S + POLL_S)
        self.client.close()


def pod_targets(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The targets of ``pod`` as file discovery takes them: ``[{"targets": [address], "labels": {...}}]``."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status", {})
    address = status.get("podIP", "")
    if not address:
        return []
    ready = next((c["status"] for c in status.get("conditions", []) if c["type"] == "Ready"), "Unknown")
    prefix = "__meta_kubernetes_pod_"
    labels = {f"{prefix}name": meta["name"], f"{prefix}ip": address, f"{prefix}ready": ready.lower()}
    labels |= {f"{prefix}phase": status.get("phase", ""), f"{prefix}node_name": spec.get("nodeName", "")}
    labels |= {f"{prefix}host_ip": status.get("hostIP", ""), f"{prefix}uid": meta.get("uid", "")}
    owner = next((o for o in meta.get("ownerReferences", []) if o.get("controller")), None)
    if owner is not None:
        labels |= {f"{prefix}controller_kind": owner["kind"], f"{prefix}controller_name": owner["name"]}
    for kind, values in (("label", meta.get("labels", {})), ("annotation", meta.get("annotations", {}))):
        for key, value in values.items():
            labels |= {f"{prefix}{kind}_{_label(key)}": value, f"{prefix}{kind}present_{_label(key)}": "true"}
    labels["__meta_kubernetes_namespace"] = meta["namespace"]
    targets = []
    containers = [(c, False) for c in spec.get("containers", [])] + [(c, True) for c in spec.get("initContainers", [])]
    for container, init in containers:
        statuses = status.get("initContainerStatuses" if init else "containerStatuses", [])
        own = {f"{prefix}container_name": container["name"], f"{prefix}container_image": container.get("image", "")}
        own[f"{prefix}container_id"] = next(
            (s.get("containerID", "") for s in statuses if s["name"] == container["name"]), ""
        )
        own[f"{prefix}container_init"] = str(init).lower()
        if not container.get("ports"):
            targets.append({"targets": [address], "labels": labels | own})
        for port in container.get("ports", []):
            number = str(port["containerPort"])
            own_port = {f"{prefix}container_port_number": number, f"{prefix}container_port_name": port.get("name", "")}
            own_port[f"{prefix}container_port_protocol"] = port.get("protocol", "TCP")
            targets.append({"targets": [f"{address}:{number}"], "labels": labels | own | own_port})
    return targets


def through_files(config: Mapping[str, Any], discovery: PodFiles) -> tuple[dict[str, Any], set[str]]:
    """``config`` with its ``kubernetes_sd_configs`` (role pod) read from ``discovery``'s files; the namespaces
    they name."""
    replaced, namespaces = dict(config), set()
    for entry in replaced.pop("kubernetes_sd_configs"):
        assert entry["role"] == "pod", entry
        names = entry.get("namespaces", {}).get("names") or [None]
        namespaces |= {name for name in names if name}
        files = [str(discovery.file(name)) for name in names]
        replaced.setdefault("file_sd_configs", []).append({"files": files})
    return replaced, namespaces


class Prometheus:
    """A Prometheus process on 127.0.0.1 scraping ``jobs`` (operator-made scrape configs) with ``discovery``'s
    targets, its data, configuration and log in ``directory``."""

    def __init__(self, directory: Path, jobs: list[dict[str, Any]], discovery: PodDiscovery) -> None:
        self.directory, self.discovery = directory, discovery
        self.started = time.time()  # the Unix time its data begins at, for the queries' windows
        replaced = [through_files(job, discovery) for job in jobs]
        discovery.refresh({name for _, names in replaced for name in names})  # the files exist before it reads them
        config = {"global": {"evaluation_interval": "15s"}, "scrape_configs": [job for job, _ in replaced]}
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        argv = [str(shutil.which("prometheus")), f"--config.file={directory / 'prometheus.yml'}"]
        argv += [f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
        with (directory / "prometheus.log").open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        discovery.thread.start()
        # httpx would take a proxy from the environment: Prometheus is on loopback
        self.client = httpx.Client(base_url=self.url, timeout=TIMEOUT_S, trust_env=False)

    def log_tail(self, lines: int = 30) -> str:
        path = self.directory / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def wait_ready(self) -> None:
        """Return once ``/-/ready`` answers 200; AssertionError with its log if it exited or is not ready in time."""
        give_up = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < give_up:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited ({self.process.returncode}):\n{self.log_tail()}")
            try:
                if self.client.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready within {READY_WITHIN_S} s:\n{self.log_tail()}")

    def api(self, path: str, **params: str | float) -> Any:
        """``data`` of an answer of the HTTP API; AssertionError with Prometheus' error (a query that does not parse
        is answered 400 bad_data) otherwise."""
        answer = self.client.get(f"/api/v1/{path}", params=params)
        body = answer.json()
        assert body.get("status") == "success", f"{path} {params}: {answer.status_code} {body}"
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant query's series, now."""
        result: list[dict[str, Any]] = self.api("query", query=promql)["result"]
        return result

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """The range query's series: those with a value at any step from ``start`` to ``end``."""
        data = self.api("query_range", query=promql, start=start, end=end, step=step_s)
        result: list[dict[str, Any]] = data["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        """The targets discovery found and relabelling kept, now."""
        active: list[dict[str, Any]] = self.api("targets", state="active")["activeTargets"]
        return active

    def stop(self) -> None:
        sweep.stop_process(self.process)
        self.discovery.stop()
        self.client.close()


class Unavailable(Exception):
    """Prometheus cannot run here: the tests that need it skip with this reason."""


def start(kubeconfig: Path, directory: Path) -> Prometheus:
    """Prometheus started with the shipped PodMonitors' scrape configs, discovering the pods through
    ``kubeconfig``'s API server; returns at once (``wait_ready`` waits). Unavailable where it is not installed."""
    if shutil.which("prometheus") is None:
        raise Unavailable("prometheus is not installed (Debian's prometheus package; .ci/run installs it)")
    jobs = [config for monitor in podmonitors() for config in scrape_configs(monitor, kubeconfig)]
    discovery = PodDiscovery(kubeconfig, directory)
    try:
        return Prometheus(directory, jobs, discovery)
    except BaseException:
        discovery.stop()
        raise
