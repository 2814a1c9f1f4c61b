"""Every check, run over one ``Snapshot``: the report ``spotdrain check`` prints and the agent exports."""

from __future__ import annotations

from collections.abc import Callable

from check.admission import check_webhook
from check.findings import GROUPS, Finding, Report, Snapshot, Unread, error
from check.installation import check_agent, check_interruption_sources, check_model_cache
from check.workloads import check_budgets, check_gateway, check_grace_periods, check_sidecar_injection

CHECKS: dict[str, Callable[[Snapshot], list[Finding]]] = {
    "agent": check_agent,
    "sidecar-injection": check_sidecar_injection,
    "budgets": check_budgets,
    "grace-periods": check_grace_periods,
    "interruption-sources": check_interruption_sources,
    "gateway": check_gateway,
    "webhook": check_webhook,
    "model-cache": check_model_cache,
}
assert tuple(CHECKS) == GROUPS[1:]


def access_finding(miss: Unread) -> Finding:
    """What a refused or unanswered read means, and the RBAC rule (or the check) that fixes it."""
    skipped = ", ".join(miss.needed_by)
    if miss.status == 403:
        message = f"cannot {miss.verb} {miss.resource} at {miss.scope}: not checked: {skipped}"
        plural, _, group = miss.resource.partition(".")
        rule = f'{{apiGroups: ["{group}"], resources: ["{plural}"], verbs: ["{miss.verb}"]}}'
        fix = f"grant {rule} (deploy/check/rbac.yaml has every rule spotdrain check needs)"
    else:
        message = f"could not {miss.verb} {miss.resource} at {miss.scope} ({miss.message}): not checked: {skipped}"
        fix = "check again; if it persists, the API server's logs say why"
    return error("access", message, [], fix)


def evaluate(snapshot: Snapshot) -> Report:
    skipped = snapshot.skipped()
    findings = [access_finding(miss) for miss in snapshot.unread]
    for group, check in CHECKS.items():
        if group not in skipped:
            findings += check(snapshot)
    return Report(tuple(findings), skipped=frozenset(skipped))
