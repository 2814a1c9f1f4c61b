"""What the readiness gate needs from the API: the Role and RoleBinding that let a pod's sidecar set its own
``spotdrain.io/serving`` condition, for the accounts of the pods ``spotdrain inject --readiness-gate`` gave the
sidecar, and whether each account is one the input defines.

The sidecar makes one call (``sidecar/gate.py``): a strategic merge patch of its own pod's status, ``PATCH
/api/v1/namespaces/<ns>/pods/<pod>/status``. So the Role grants ``patch`` on ``pods/status`` and nothing else; it
cannot name the pods (``resourceNames``), whose names the ReplicaSet makes up. A pod's account is its
``serviceAccountName``; the namespace's ``default`` account is never bound: every pod of the namespace that names no
account runs as it, and would get the same right over every pod's status.

The ServiceAccount itself is not printed: a manifest that names an account it does not define has it defined
elsewhere, and a bare one applied over it (``kubectl apply`` merges against what was last applied from the other
file) would drop what that file set, an IRSA role annotation or ``automountServiceAccountToken: false``. Its name
is said instead.
"""

from __future__ import annotations

from collections.abc import Iterable

from inject.spec import GATE, Obj

ROLE = "spotdrain-readiness-gate"
DEFAULT = "default"
RBAC = "rbac.authorization.k8s.io"
LABELS = {"app.kubernetes.io/part-of": "spotdrain"}

Account = tuple[str | None, str]  # namespace (None: the one it is applied in), service account name
ObjectId = tuple[str, str | None, str]  # kind, namespace, name


def _metadata(name: str, namespace: str | None) -> Obj:
    return {"name": name, **({"namespace": namespace} if namespace else {}), "labels": dict(LABELS)}


def role(namespace: str | None) -> Obj:
    return {
        "apiVersion": f"{RBAC}/v1",
        "kind": "Role",
        "metadata": _metadata(ROLE, namespace),
        "rules": [{"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]}],
    }


def binding(namespace: str | None, account: str) -> Obj:
    # A ServiceAccount subject without a namespace is the binding's own namespace's
    # (plugin/pkg/auth/authorizer/rbac/rbac.go, appliesToUser): the pair lands together wherever it is applied.
    subject = {"kind": "ServiceAccount", "name": account, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": f"{RBAC}/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(f"{account}-{ROLE}", namespace),
        "roleRef": {"apiGroup": RBAC, "kind": "Role", "name": ROLE},
        "subjects": [subject],
    }


def gate_objects(accounts: Iterable[Account], present: set[ObjectId]) -> list[Obj]:
    """The Role and RoleBindings the accounts' pods need for the gate, each once, leaving out any the input has
    already (same kind, namespace and name) and the ``default`` accounts."""
    wanted: list[Obj] = []
    for namespace, account in dict.fromkeys(accounts):
        if account != DEFAULT:
            wanted += [role(namespace), binding(namespace, account)]
    out: list[Obj] = []
    seen = set(present)
    for obj in wanted:
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key not in seen:
            seen.add(key)
            out.append(obj)
    return out


def undefined_accounts(accounts: Iterable[Account], present: set[ObjectId]) -> list[Account]:
    """The accounts (``default`` aside) that no ServiceAccount of the input defines: they must exist already."""
    return [
        (namespace, account)
        for namespace, account in dict.fromkeys(accounts)
        if account != DEFAULT and ("ServiceAccount", namespace, account) not in present
    ]


def default_account_advice(where: str) -> str:
    return (
        f"{where} runs as its namespace's default ServiceAccount, which is not granted patch on pods/status: every "
        f"pod of the namespace without an account of its own would get it too. Give it one (create a "
        f"ServiceAccount, name it in serviceAccountName) and run this again, or grant it yourself; until then its "
        f"{GATE} condition is never set and it is never Ready"
    )
