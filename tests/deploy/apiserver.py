"""Rendered manifests sent to the real kube-apiserver (``tests.control_plane``) as ``kubectl apply`` sends them to a
new cluster, but as a server-side dry run: each object is created with ``dryRun=All``, so the API server validates
it, defaults it and runs every admission plugin on it without storing it
(https://kubernetes.io/docs/reference/using-api/api-concepts/#dry-run), with ``fieldValidation=Strict``, kubectl's
default since 1.27 (``--validate=strict``), so an unknown or duplicated field is refused as kubectl refuses it, and
with the ``last-applied-configuration`` annotation kubectl apply adds (its size counts toward the 256 KiB limit of an
object's annotations).

What the API server cannot take from a dry run is made for real first: the CRDs of the custom kinds (from the shared
folder), and the namespaces the objects go in. A dry-run create of a Namespace does not make it, and a namespaced
object whose namespace is not there is refused (NamespaceLifecycle admission), so a rendering's own Namespace objects
are created for real, and those it expects the user to provide (deploy/PLACEHOLDERS.md) are made as the cluster's.

The session's plane runs without the ServiceAccount admission plugin, which judges Pods alone
(plugin/pkg/admission/serviceaccount/admission.go, ``shouldIgnore``); a rendering holds workloads, never a Pod. Its
administrator is in system:masters, as a user applying the manifests would be a cluster administrator, so RBAC's
escalation check lets it create any Role or binding.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.control_plane import ControlPlane
from tests.deploy.manifests import CRDS, Obj
from tests.real_kube_http import Admin

CRD_COLLECTION = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# The query kubectl apply's create carries (--validate=strict), with the dry run.
DRY_RUN = {"dryRun": "All", "fieldValidation": "Strict", "fieldManager": "kubectl-client-side-apply"}
SERVED_WITHIN_S = 30.0
# What kubectl gives an object of a namespaced kind that names no namespace: its context's namespace.
CONTEXT_NAMESPACE = "default"
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


@dataclass(frozen=True)
class Kind:
    """Where objects of one kind are created, from the API server's discovery."""

    collection: str  # /api/v1 or /apis/GROUP/VERSION, then the plural
    namespaced: bool

    def path(self, namespace: str | None) -> str:
        prefix, _, plural = self.collection.rpartition("/")
        return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else self.collection


@dataclass(frozen=True)
class Answer:
    """What the API server said of each object of one rendering."""

    refused: list[str]  # "Kind namespace/name: <status> <reason>: <message>"
    warnings: list[str]  # "Kind namespace/name: <Warning header's text>"
    unchecked: list[str]  # objects of a kind the API server does not serve (no CRD in the shared folder)


def describe(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind')} {where}{meta.get('name')}"


def as_applied(obj: Obj) -> Obj:
    """``obj`` as ``kubectl apply`` creates it: annotated with itself, as JSON (kubectl's
    ``GetModifiedConfiguration``, staging/src/k8s.io/kubectl/pkg/util/apply.go)."""
    meta = obj.get("metadata") or {}
    annotations = {**(meta.get("annotations") or {}), LAST_APPLIED: json.dumps(obj, separators=(",", ":")) + "\n"}
    return {**obj, "metadata": {**meta, "annotations": annotations}}


def _warnings(answer: httpx.Response) -> list[str]:
    # RFC 7234 warn-values as the API server writes them: 299 - "text", a quoted-string with backslash escapes
    # (NewWarningHeader, k8s.io/apimachinery/pkg/util/net/http.go).
    texts = []
    for value in answer.headers.get_list("warning"):
        code, _, rest = value.partition(" - ")
        quoted = rest.strip()
        if code == "299" and len(quoted) > 1 and quoted[0] == quoted[-1] == '"':
            texts.append(re.sub(r"\\(.)", r"\1", quoted[1:-1]))
        else:
            texts.append(value)
    return texts


def _failure(answer: httpx.Response) -> str:
    try:
        status: dict[str, Any] = answer.json()
    except ValueError:
        return f"{answer.status_code}: {answer.text[:500]}"
    return f"{answer.status_code} {status.get('reason', '')}: {status.get('message', status)}"


class DryRunServer:
    """One real API server for every rendering: the shared folder's CRDs installed once, each kind looked up once
    in the API server's discovery, and each object answered by a dry-run create."""

    def __init__(self, plane: ControlPlane) -> None:
        self.admin = Admin(plane.url, plane.ca_path, plane.admin_token)
        self.client = self.admin.client
        self._kinds: dict[str, dict[str, Kind]] = {}

    def close(self) -> None:
        self.admin.close()

    def submit(self, objects: Iterable[Obj]) -> Answer:
        """Dry-run create ``objects`` (a rendering): its namespaces first, for real, then every other object."""
        answer = Answer([], [], [])
        known = []
        for obj in objects:
            if self.kind(obj) is None:
                answer.unchecked.append(describe(obj))
            else:
                known.append(obj)
        own = [o for o in known if (o["apiVersion"], o["kind"]) == ("v1", "Namespace")]
        for namespace in own:
            self._create_namespace(namespace, answer)
        made = {n["metadata"]["name"] for n in own}
        for obj in (o for o in known if o not in own):
            kind = self.kind(obj)
            assert kind is not None
            where = (obj["metadata"].get("namespace") or CONTEXT_NAMESPACE) if kind.namespaced else None
            if where is not None and where not in made:
                # One the user provides (deploy/PLACEHOLDERS.md, "Namespaces you provide"), or Kubernetes' own.
                self.admin.ensure_namespace(where)
                made.add(where)
            self._record(obj, self.client.post(kind.path(where), params=DRY_RUN, json=as_applied(obj)), answer)
        return answer

    def _create_namespace(self, namespace: Obj, answer: Answer) -> None:
        """Create the Namespace for real; one an earlier rendering made is checked by a dry-run server-side apply
        of this rendering's object instead (kubectl apply --server-side --dry-run=server)."""
        collection = "/api/v1/namespaces"
        real = {k: v for k, v in DRY_RUN.items() if k != "dryRun"}
        created = self.client.post(collection, params=real, json=as_applied(namespace))
        if created.status_code == 409:
            created = self.client.patch(
                f"{collection}/{namespace['metadata']['name']}",
                params={**DRY_RUN, "fieldManager": "kubectl", "force": "true"},
                content=yaml.safe_dump(namespace).encode(),
                headers={"Content-Type": "application/apply-patch+yaml"},
            )
        self._record(namespace, created, answer)

    @staticmethod
    def _record(obj: Obj, response: httpx.Response, answer: Answer) -> None:
        answer.warnings.extend(f"{describe(obj)}: {text}" for text in _warnings(response))
        if response.status_code >= 400:
            answer.refused.append(f"{describe(obj)}: {_failure(response)}")

    # Kinds ------------------------------------------------------------------------------------------------------------

    def install_crds(self) -> None:
        """Create every CRD of the shared folder, then wait until the API server serves each kind. All at once:
        for about 2 s after it first serves a kind, the API server holds the first create of it (measured here), and
        so these waits overlap instead of adding up."""
        crds = [_load(path) for path in sorted(CRDS.glob("*.yaml"))] if CRDS.is_dir() else []
        for crd in crds:
            answer = self.client.post(CRD_COLLECTION, json=crd)
            if answer.status_code not in (201, 409):  # 409: the session's plane has it already
                raise AssertionError(f"the API server refuses the CRD {crd['metadata']['name']}: {_failure(answer)}")
        for crd in crds:
            for version in crd["spec"]["versions"]:
                if version.get("served", True):
                    self._wait_served(f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])

    def kind(self, obj: Obj) -> Kind | None:
        """Where the API server serves ``obj``'s kind; None for a kind it does not serve."""
        return self._served(str(obj.get("apiVersion"))).get(str(obj.get("kind")))

    def _served(self, api_version: str) -> dict[str, Kind]:
        """The kinds the API server serves in ``api_version``, by its discovery (kept once it answers: what a group
        version serves only grows here)."""
        if api_version in self._kinds:
            return self._kinds[api_version]
        base = f"/apis/{api_version}" if "/" in api_version else f"/api/{api_version}"
        answer = self.client.get(base)
        if answer.status_code == 404:
            return {}
        answer.raise_for_status()
        resources = [r for r in answer.json()["resources"] if "/" not in r["name"]]  # not a subresource
        kinds = {r["kind"]: Kind(f"{base}/{r['name']}", r["namespaced"]) for r in resources}
        self._kinds[api_version] = kinds
        return kinds

    def _wait_served(self, api_version: str, kind: str) -> Kind:
        """Once the CRD is established, its group version's discovery lists the kind (a moment later)."""
        give_up = time.monotonic() + SERVED_WITHIN_S
        while (found := self._served(api_version).get(kind)) is None:
            if time.monotonic() > give_up:
                raise TimeoutError(f"{kind} ({api_version}) not served within {SERVED_WITHIN_S} s of its CRD")
            self._kinds.pop(api_version, None)
            time.sleep(0.1)
        return found


def _load(path: Path) -> Obj:
    loaded: Obj = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    return loaded
