"""How a report is printed: grouped lines with ✓ / ⚠ / ✗ for people, a JSON list of findings for CI."""

from __future__ import annotations

import json

from check.findings import GROUPS, Report

MARKS = {"ok": "✓", "warning": "⚠", "error": "✗"}
TITLES = {
    "access": "access",
    "agent": "node agent",
    "sidecar-injection": "sidecar injection",
    "budgets": "disruption budgets",
    "grace-periods": "grace periods",
    "interruption-sources": "interruption sources",
    "gateway": "gateway",
    "webhook": "webhook",
    "model-cache": "model cache",
}


def as_json(report: Report) -> str:
    return json.dumps([finding.public() for finding in report.findings], indent=2)


def as_text(report: Report) -> str:
    if report.unreachable is not None:
        return f"✗ could not read the cluster: {report.unreachable}\n"
    lines: list[str] = []
    for group in GROUPS:
        findings = [f for f in report.findings if f.check == group]
        if group in report.skipped:
            lines += [TITLES[group], "  - not checked: a read it needs failed (see access)"]
            continue
        if not findings:
            continue
        lines.append(TITLES[group])
        for finding in findings:
            lines.append(f"  {MARKS[finding.severity]} {finding.message}")
            if finding.severity != "ok" and finding.objects:
                lines.append(f"      objects: {', '.join(finding.objects)}")
            if finding.fix:
                lines.append(f"      fix: {finding.fix}")
    errors = sum(1 for f in report.findings if f.severity == "error")
    warnings = sum(1 for f in report.findings if f.severity == "warning")
    lines.append(f"\n{errors} errors, {warnings} warnings")
    return "\n".join(lines) + "\n"
