"""Who a request to the fake Kubernetes API comes from, and whether it may do what it asks.

The fake holds no RBAC objects: each bearer token names a user and the (verb, resource) pairs it may not use, and
everything else is allowed. That is enough to answer as the API server does when a token is wrong or a Role is
missing: 401 before anything else for no token or an unknown one, and 403 Forbidden in the authorizer's words
(apiserver's endpoints/handlers/responsewriters/errors.go ``forbiddenMessage``, wrapped by apimachinery's
``NewForbidden``): ``pods "vllm-0" is forbidden: User "system:serviceaccount:ml:vllm" cannot patch resource
"pods/status" in API group "" in the namespace "ml"``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from simulate.fakes.kube_resources import Target
from simulate.fakes.kube_select import KubeError, Obj, flag
from spotdrain.clock import rfc3339, utcnow

ADMIN = "kubernetes-admin"
_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


AUDIENCE = "https://kubernetes.default.svc.cluster.local"  # the API server's own, its --service-account-issuer


def user_info(user: str) -> Obj:
    """The name and groups an authenticator gives ``user``: a service account's come from its namespace
    (k8s.io/apiserver/pkg/authentication/serviceaccount/util.go ``MakeGroupNames``), the administrator is in
    ``system:masters``; every authenticated user is in ``system:authenticated``."""
    if user.startswith("system:serviceaccount:"):
        namespace = user.split(":")[2]
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"]
    else:
        groups = ["system:masters"]
    return {"username": user, "groups": [*groups, "system:authenticated"]}


@dataclass(frozen=True)
class Account:
    user: str
    denied: frozenset[tuple[str, str]]  # (verb, resource[/subresource]): ("patch", "pods/status")


def verb(method: str, target: Target, query: Mapping[str, str]) -> str:
    """The authorizer's verb for a request (the API server's RequestInfo): ``get``, ``list``, ``patch``..."""
    if method == "GET":
        if target.name is not None:
            return "get"
        return "watch" if flag(query, "watch") else "list"
    if method == "DELETE":
        return "delete" if target.name is not None else "deletecollection"
    return _VERBS.get(method, method.lower())


class Accounts:
    """The tokens the server knows: one that may do anything, and those issued with things they may not do."""

    def __init__(self, admin_token: str) -> None:
        self._by_token = {admin_token: Account(ADMIN, frozenset())}

    def issue(self, user: str, *, denied: Iterable[tuple[str, str]] = ()) -> str:
        """A new token for ``user``, refused (403) each (verb, resource) in ``denied``."""
        token = secrets.token_urlsafe(32)
        self._by_token[token] = Account(user, frozenset(denied))
        return token

    def authenticate(self, authorization: str) -> Account:
        scheme, _, token = authorization.partition(" ")
        account = self._by_token.get(token) if scheme == "Bearer" else None
        if account is None:
            raise KubeError(401, "Unauthorized", "Unauthorized")
        return account

    def review(self, account: Account, target: Target, body: object) -> Obj:
        """The answer to a SelfSubjectReview (who ``account`` is) or a TokenReview (who the body's token is), as
        pkg/registry/authentication/{selfsubjectreview,tokenreview}/rest.go give them: 201 either way, an unknown
        token as ``status.error`` "invalid bearer token" with an empty user."""
        meta = {"creationTimestamp": rfc3339(utcnow().replace(microsecond=0))}
        answer: Obj = {"kind": target.resource.kind, "apiVersion": target.resource.group_version, "metadata": meta}
        if target.resource.plural == "selfsubjectreviews":
            return answer | {"status": {"userInfo": user_info(account.user)}}
        spec = body.get("spec", {}) if isinstance(body, dict) else {}
        reviewed = self._by_token.get(str(spec.get("token", "")))
        if reviewed is None:
            return answer | {"spec": spec, "status": {"user": {}, "error": "invalid bearer token"}}
        status = {"authenticated": True, "user": user_info(reviewed.user), "audiences": [AUDIENCE]}
        return answer | {"spec": spec, "status": status}

    def authorize(self, account: Account, method: str, target: Target, query: Mapping[str, str]) -> None:
        resource = target.resource
        plural = f"{resource.plural}/{target.subresource}" if target.subresource else resource.plural
        action = verb(method, target, query)
        if (action, plural) not in account.denied:
            return
        scope = f'in the namespace "{target.namespace}"' if target.namespace else "at the cluster scope"
        why = f'User "{account.user}" cannot {action} resource "{plural}" in API group "{resource.group}" {scope}'
        subject = f'{resource.qualified} "{target.name}"' if target.name else resource.qualified
        details = {"name": target.name or "", "kind": resource.plural} | (
            {"group": resource.group} if resource.group else {}
        )
        raise KubeError(403, "Forbidden", f"{subject} is forbidden: {why}", details=details)
