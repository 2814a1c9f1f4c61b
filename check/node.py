"""``spotdrain check --node NAME``: find the node agent on that node and ask it what it sees, through the API
server's pod proxy (``GET pods/proxy`` in the agent's namespace: the agent's port is never reached directly), beside
the node and the pods on it, read with ``list`` calls. The first thing to run when a node was interrupted and
streams were cut anyway."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import quote

import aiohttp

from check import objects as o
from check.findings import Finding, Report, Unread
from check.node_findings import NodeView, node_findings
from check.reading import Read, Reader, Unreachable, attempt
from check.report import MARKS
from check.rules import access_finding
from check.settings import CheckSettings
from spotdrain.clock import utcnow
from spotdrain.kube_rest import Access, call
from spotdrain.retry import ApiError

STATUS_PATH = "/v1/status"  # agent/status.py, on the agent's metrics port
METRICS_PORT = 8089  # the DaemonSet's port named "metrics"


@dataclass(frozen=True)
class NodeReport:
    view: NodeView
    findings: tuple[Finding, ...]

    @property
    def exit_code(self) -> int:
        return Report(self.findings).exit_code


def _reads(name: str, agent_namespace: str) -> tuple[Read, Read, Read]:
    on_node = (("fieldSelector", f"spec.nodeName={name}"),)
    return (
        Read("nodes", "/api/v1/nodes", "nodes", ("agent",), (("fieldSelector", f"metadata.name={name}"),)),
        Read("agent_pods", f"/api/v1/namespaces/{agent_namespace}/pods", "pods", ("agent",), on_node),
        Read("pods", "/api/v1/pods", "pods", ("sidecars", "drain"), on_node),
    )


def _metrics_port(agent: o.Obj) -> int:
    container = o.running(o.spec(agent), "node") or {}
    for port in container.get("ports") or []:
        if isinstance(port, dict) and port.get("name") == "metrics":
            return int(port.get("containerPort", METRICS_PORT))
    return METRICS_PORT


async def ask_agent(reader: Reader, agent: o.Obj) -> dict[str, object] | Unread | str:
    """The agent's ``/v1/status``; an Unread when the proxy is refused, the reason when the agent does not answer."""
    namespace, name = o.namespace(agent), o.name(agent)
    path = f"/api/v1/namespaces/{namespace}/pods/{quote(name)}:{_metrics_port(agent)}/proxy{STATUS_PATH}"
    try:
        return await call(reader.session, reader.access, "GET", path, timeout_s=reader.timeout_s)
    except ApiError as error:
        if error.status in (401, 403):
            return Unread("get", "pods/proxy", f"namespace {namespace}", error.status, str(error), ("agent",))
        return str(error)


async def read_node(reader: Reader, name: str, *, agent_namespace: str, now: datetime) -> NodeReport:
    """Raises Unreachable when the API server cannot be read at all."""
    results = [await attempt(reader.items, read) for read in _reads(name, agent_namespace)]
    unread = [r for r in results if isinstance(r, Unread)]
    nodes, agents, pods = ([] if isinstance(r, Unread) else r for r in results)
    agent = next((p for p in agents if o.running(o.spec(p), "node")), None)
    status, why = None, None
    if agent is not None and not unread:
        answer = await ask_agent(reader, agent)
        if isinstance(answer, Unread):
            unread.append(answer)
        elif isinstance(answer, str):
            why = answer
        else:
            status = answer
    view = NodeView(name, now, nodes[0] if nodes else None, agent, status, why, tuple(pods))
    if unread:
        return NodeReport(view, tuple(access_finding(miss) for miss in unread))
    return NodeReport(view, tuple(node_findings(view)))


def as_text(report: NodeReport) -> str:
    lines = [f"node {report.view.name}"]
    for finding in report.findings:
        lines.append(f"  {MARKS[finding.severity]} {finding.message}")
        if finding.fix:
            lines.append(f"      fix: {finding.fix}")
    return "\n".join(lines) + "\n"


def as_json(report: NodeReport) -> str:
    document = {
        "node": report.view.name,
        "agent": report.view.status,
        "findings": [finding.public() for finding in report.findings],
    }
    return json.dumps(document, indent=2)


async def show_node(access: Access, settings: CheckSettings) -> int:
    assert settings.node is not None
    async with aiohttp.ClientSession() as session:
        reader = Reader(session, access, timeout_s=settings.timeout_s)
        try:
            report = await read_node(reader, settings.node, agent_namespace=settings.agent_namespace, now=utcnow())
        except Unreachable as error:
            print(f"✗ could not read the cluster: {error}")
            return 2
    sys.stdout.write(as_json(report) + "\n" if settings.output == "json" else as_text(report))
    return report.exit_code
