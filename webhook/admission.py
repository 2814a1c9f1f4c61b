"""What the webhook answers to an AdmissionReview: pure functions of the request body and the inject options.

The format is the API server's (admission.k8s.io/v1, https://kubernetes.io/docs/reference/access-authn-authz/
extensible-admission-controllers/#response and https://kubernetes.io/docs/reference/config-api/
apiserver-admission.v1/): the response repeats the request's ``uid``, says ``allowed``, and carries a mutation as
``patchType: JSONPatch`` with the RFC 6902 patch base64-encoded in ``patch``. ``warnings`` are shown to the client
that created the object (kubectl prints them); the API server may truncate one past 256 characters.

A Pod is never denied: one this cannot inject is admitted as it came, with a warning that says why, so the
webhook can only ever add the sidecar, never block a deployment.
"""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from inject.pods import InjectError, Obj, Options, PodTarget, containers_of, has_sidecar, inject_pod
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


def _not_found(pod: Obj, options: Options) -> str:
    names = [str(c.get("name")) for c in containers_of(pod["spec"], "containers", "spec")]
    if options.container is not None:
        return f"no container named {options.container!r} (the webhook's --container) among {', '.join(names)}"
    return f"no engine container found among {', '.join(names) or 'no containers'} (vLLM, TGI or SGLang by image)"


def mutate(request: Obj, options: Options) -> tuple[list[Obj], list[str]]:
    """The patch that gives the request's Pod the sidecar, and the warnings to show; both empty to leave it be."""
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
        target = PodTarget(spec, "spec")
        if has_sidecar(target):
            return [], []
        if not inject_pod(target, options):
            return [], [f"spotdrain: the sidecar was not added: {_not_found(pod, options)}"]
    except InjectError as error:
        return [], [f"spotdrain: the sidecar was not added: {error}"]
    return diff(pod, after), []


def review(body: bytes, options: Options) -> Obj:
    """The AdmissionReview to answer ``body`` with; raises BadReview for a body that is not one."""
    request = parse(body)
    patch, warnings = mutate(request, options)
    return answer(request["uid"], patch=patch, warnings=warnings)
