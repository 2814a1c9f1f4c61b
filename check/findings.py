"""What ``spotdrain check`` says: findings, the cluster objects they are read from, and the exit status they make.

``Snapshot`` holds what was read (plain dicts, as the API returns them) and what could not be read; the checks are
pure functions of it and of ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

Severity = Literal["error", "warning", "ok"]
Obj = dict[str, Any]

# The groups, in the order they are printed; each finding's ``check`` is one of them.
GROUPS = (
    "access",
    "agent",
    "sidecar-injection",
    "budgets",
    "grace-periods",
    "interruption-sources",
    "gateway",
    "webhook",
    "model-cache",
)
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "ok")


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str
    message: str
    objects: tuple[str, ...] = ()  # Kind/namespace/name, or Kind/name when cluster-scoped
    fix: str = ""

    def public(self) -> dict[str, Any]:
        return {
            "severity": self.severity,
            "check": self.check,
            "objects": list(self.objects),
            "message": self.message,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Unread:
    """A read the API refused or did not answer: ``verb`` on ``resource`` (``daemonsets.apps``) in ``scope``."""

    verb: str
    resource: str
    scope: str  # "the cluster scope", or "namespace NAME"
    status: int  # 403, 404, ..., 0 for no answer
    message: str
    needed_by: tuple[str, ...]  # the groups that could not run without it


@dataclass(frozen=True)
class Snapshot:
    now: datetime
    nodes: tuple[Obj, ...] = ()
    namespaces: tuple[Obj, ...] = ()
    daemonsets: tuple[Obj, ...] = ()
    deployments: tuple[Obj, ...] = ()
    webhooks: tuple[Obj, ...] = ()  # MutatingWebhookConfigurations
    agent_pods: tuple[Obj, ...] = ()  # the pods of the node agent's DaemonSets
    pods: tuple[Obj, ...] = ()  # the workload pods in scope (--namespace, --selector)
    budgets: tuple[Obj, ...] = ()
    services: tuple[Obj, ...] = ()
    slices: tuple[Obj, ...] = ()  # EndpointSlices
    unread: tuple[Unread, ...] = ()
    namespace: str | None = None  # --namespace: the workload reads were narrowed to it

    def skipped(self) -> set[str]:
        """The groups that cannot be judged: one of their reads failed."""
        return {group for miss in self.unread for group in miss.needed_by}


@dataclass(frozen=True)
class Report:
    findings: tuple[Finding, ...]
    unreachable: str | None = None  # the cluster could not be read at all: why
    skipped: frozenset[str] = field(default_factory=frozenset)

    @property
    def exit_code(self) -> int:
        """0 no error, 1 errors found, 2 the cluster (or part of what the checks need) could not be read."""
        if self.unreachable is not None or any(f.check == "access" for f in self.findings if f.severity == "error"):
            return 2
        return 1 if any(f.severity == "error" for f in self.findings) else 0


def ok(check: str, message: str, *objects: str) -> Finding:
    return Finding("ok", check, message, tuple(objects))


def error(check: str, message: str, objects: tuple[str, ...] | list[str], fix: str) -> Finding:
    return Finding("error", check, message, tuple(objects), fix)


def warning(check: str, message: str, objects: tuple[str, ...] | list[str], fix: str) -> Finding:
    return Finding("warning", check, message, tuple(objects), fix)


def listed(items: list[str], most: int = 5) -> str:
    """``a, b, c`` or ``a, b, c, d, e and 7 more``."""
    if len(items) <= most:
        return ", ".join(items)
    return f"{', '.join(items[:most])} and {len(items) - most} more"
