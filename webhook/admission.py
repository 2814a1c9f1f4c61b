"""What the webhook answers to an AdmissionReview: pure functions of the request body and the inject options.

The format is the API server's (admission.k8s.io/v1, https://kubernetes.io/docs/reference/access-authn-authz/
extensible-admission-controllers/#response and https://kubernetes.io/docs/reference/config-api/
apiserver-admission.v1/): the response repeats the request's ``uid``, says ``allowed``, and carries a mutation as
``patchType: JSONPatch`` with the RFC 6902 patch base64-encoded in ``patch``. ``warnings`` are shown to the client
that created the object (kubectl prints them); the API server may truncate one past 256 characters.

A Pod is never denied: one this cannot inject is admitted as it came, with a warning that says why, so the
webhook can only ever add the sidecar, never block a deployment. A value of the Pod's that injecting changes (a
grace period too short for the drain) is named in a warning too.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from inject.pods import inject_pod
from inject.spec import InjectError, Obj, Options, PodTarget
from webhook.patch import diff

API_VERSION = "admission.k8s.io/v1"
LABEL = "spotdrain.io/inject"  # "true" on a Pod or its namespace asks for the sidecar; "false" on a Pod declines
WARNING_CHARS = 256


class BadReview(ValueError):
    """The body is not an AdmissionReview request this can answer; the server says 400."""


def parse(body: bytes) -> Obj:
    """The review's request, checked for what an answer needs; raises BadReview otherwise."""
    try:
        review = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise BadReview(f"not JSON: {error}") from None
    if not isinstance(review, dict) or review.get("kind") != "AdmissionReview":
        raise BadReview("not an AdmissionReview")
    if review.get("apiVersion") != API_VERSION:
        raise BadReview(f"apiVersion {review.get('apiVersion')!r}: only {API_VERSION} is served")
    request = review.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str) or not request["uid"]:
        raise BadReview("no request with a uid")
    return request


def answer(uid: str, *, patch: list[Obj] | None = None, warnings: list[str] | None = None) -> Obj:
    response: Obj = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
    if warnings:
        response["warnings"] = [warning[:WARNING_CHARS] for warning in warnings]
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _labels(pod: Obj) -> dict[str, Any]:
    metadata = pod.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, dict) else None
    return labels if isinstance(labels, dict) else {}


def wants_sidecar(pod: Obj) -> bool:
    """Whether the Pod is asking for the sidecar, as far as the Pod tells.

    Its own label decides when it has one. Without it, the request came through the configuration's
    namespaceSelector (the namespace carries the label): the review holds no namespace labels to check, so the
    selector is trusted.
    """
    label = _labels(pod).get(LABEL)
    return label is None or label == "true"


NOT_ADDED = "spotdrain: the sidecar was not added: "


def mutate(request: Obj, options: Options) -> tuple[list[Obj], list[str]]:
    """The patch that gives the request's Pod the sidecar, and the warnings to show; both empty to leave it be.
    Warnings without a patch say why the Pod was left as it came; with one, what of the Pod's it changed."""
    pod = request.get("object")
    if request.get("operation", "CREATE") != "CREATE" or not isinstance(pod, dict) or pod.get("kind") != "Pod":
        return [], []
    if not wants_sidecar(pod):
        return [], []
    after = copy.deepcopy(pod)
    try:
        spec = after.get("spec")
        if not isinstance(spec, dict):
            raise InjectError("spec is not a mapping")
        outcome = inject_pod(PodTarget(spec, "spec"), options)
    except InjectError as error:
        return [], [NOT_ADDED + str(error)]
    if not outcome.injected:
        return [], [NOT_ADDED + outcome.skipped] if outcome.skipped else []
    return diff(pod, after), [f"spotdrain: {change}" for change in outcome.changed]


def review(body: bytes, options: Options) -> Obj:
    """The AdmissionReview to answer ``body`` with; raises BadReview for a body that is not one."""
    request = parse(body)
    patch, warnings = mutate(request, options)
    return answer(request["uid"], patch=patch, warnings=warnings)
