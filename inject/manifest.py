"""The manifest side of ``spotdrain inject``: find the engines in a stream of YAML documents (documents, objects,
pod specs, the engine container in each), and write back only the documents that change.

The stream is cut into documents at their ``---`` lines (a document marker at the start of a line ends any block
scalar, so the cut is exact), and each document is parsed with PyYAML to locate its objects. A document with
nothing to inject is copied through as text, byte for byte: its comments, quoting, key order and indentation stay
as they were. A document that changes is dumped again from the parsed object, keeping the comment lines before and
after it; comments inside it are lost. Editing the text in place would keep those too, but PyYAML does not keep
the positions needed to do that safely for every style of YAML, and a reformatted document that is right is worth
more than a preserved comment in a document that might not be.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from inject.pods import Outcome, inject_pod
from inject.spec import ALWAYS_ALLOW, POLICY, InjectError, Obj, Options, PodTarget, section
from inject.validate import missing_fields

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet")
RAY_KINDS = ("RayCluster", "RayService")
_MARKER = re.compile(r"---(?:[ \t].*)?\r?\n?")
_COMMENT = re.compile(r"(?:---[ \t]*(?:#.*)?|[ \t]*(?:#.*)?|%.*)\r?\n?")


@dataclass(frozen=True)
class Document:
    number: int  # 1-based, counting every document marker
    line: int  # 1-based line of its first line
    text: str

    @property
    def name(self) -> str:
        return f"document {self.number} (line {self.line})"


def split_documents(text: str) -> list[Document]:
    """Cut ``text`` into documents at lines that start with ``---``; joined again they are ``text`` exactly."""
    documents: list[Document] = []
    current: list[str] = []
    start = 1
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if _MARKER.fullmatch(line) and current:
            documents.append(Document(len(documents) + 1, start, "".join(current)))
            current, start = [], number
        current.append(line)
    if current:
        documents.append(Document(len(documents) + 1, start, "".join(current)))
    return documents


def _mapping(value: Any, where: str) -> Obj:
    if not isinstance(value, dict):
        raise InjectError(f"{where} is not a mapping")
    return value


def pod_targets(obj: Obj) -> list[PodTarget]:
    """Every pod spec of a workload object that could run an engine; none for other kinds."""
    kind = obj.get("kind")
    if kind == "Pod":
        return [PodTarget(_mapping(obj.get("spec"), "spec"), "spec")]
    if kind in WORKLOAD_KINDS:
        template = _mapping(_mapping(obj.get("spec"), "spec").get("template"), "spec.template")
        return [PodTarget(_mapping(template.get("spec"), "spec.template.spec"), "spec.template.spec")]
    if kind not in RAY_KINDS:
        return []
    spec, prefix = _mapping(obj.get("spec"), "spec"), "spec"
    if kind == "RayService":
        spec, prefix = _mapping(spec.get("rayClusterConfig"), "spec.rayClusterConfig"), "spec.rayClusterConfig"
    groups = [(f"{prefix}.headGroupSpec", spec["headGroupSpec"])] if "headGroupSpec" in spec else []
    workers = spec.get("workerGroupSpecs") or []
    if not isinstance(workers, list):
        raise InjectError(f"{prefix}.workerGroupSpecs is not a list")
    groups += [(f"{prefix}.workerGroupSpecs[{i}]", group) for i, group in enumerate(workers)]
    return [_ray_target(_mapping(group, where), where) for where, group in groups]


def _ray_target(group: Obj, where: str) -> PodTarget:
    template = _mapping(group.get("template"), f"{where}.template")
    params = _mapping(group.get("rayStartParams") or {}, f"{where}.rayStartParams")
    return PodTarget(_mapping(template.get("spec"), f"{where}.template.spec"), f"{where}.template.spec", params)


@dataclass(frozen=True)
class PodResult:
    """What became of one pod spec of the input, and who the pods it makes run as."""

    where: str  # "Deployment default/vllm spec.template.spec"
    outcome: Outcome
    namespace: str | None  # None: the namespace it is applied in
    account: str  # its serviceAccountName; "default" when it names none


def _account(spec: Obj) -> str:
    # serviceAccount is the field's deprecated alias, still honoured when serviceAccountName is unset.
    return str(spec.get("serviceAccountName") or spec.get("serviceAccount") or "default")


def inject_into(obj: Obj, options: Options) -> list[PodResult]:
    """Inject into every pod spec of ``obj`` (a ``List``'s items too), in place; returns what became of each."""
    if isinstance(obj.get("items"), list):  # kind: List, as `kubectl get -o yaml` prints
        items = [_mapping(item, f"items[{i}]") for i, item in enumerate(obj["items"])]
        return [result for item in items for result in inject_into(item, options)]
    namespace = _metadata(obj).get("namespace")
    where, ns = _describe(obj), str(namespace) if namespace else None
    return [PodResult(f"{where} {t.where}", inject_pod(t, options), ns, _account(t.spec)) for t in pod_targets(obj)]


def invalid_fields(obj: Obj) -> list[str]:
    """The required fields ``obj`` (or a ``List``'s items) lacks, each with the object it belongs to."""
    if isinstance(obj.get("items"), list):
        return [f for i, item in enumerate(obj["items"]) if isinstance(item, dict) for f in invalid_fields(item)]
    kind = f"{obj.get('apiVersion')} {obj.get('kind')}"
    return [f"{_describe(obj)}: {field} is missing: not a valid {kind}" for field in missing_fields(obj)]


def container_names(obj: Obj) -> set[str]:
    """Names of the containers in every pod spec of ``obj``, to tell a mistyped --container from a done one."""
    if isinstance(obj.get("items"), list):
        return {name for item in obj["items"] if isinstance(item, dict) for name in container_names(item)}
    return {str(c.get("name")) for t in pod_targets(obj) for c in t.spec.get("containers") or [] if isinstance(c, dict)}


class _Dumper(yaml.SafeDumper):
    """Block style, no anchors, multi-line strings as literal blocks (scripts stay readable)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not value[:1].isspace() else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


class _DuplicateKey(yaml.constructor.ConstructorError):
    pass


class _Loader(yaml.SafeLoader):
    """Safe loading that refuses a key given twice in one mapping. PyYAML keeps the last one silently, so a document
    written back would lose the other without a word; kubectl refuses such a document too (``mapping key "x"
    already defined``). Keys that come from a merge (``<<: *base``) may be overridden, as YAML means them to be."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], int] = {}
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                line = key.start_mark.line + 1
                if (key.tag, key.value) in seen:
                    first = seen[(key.tag, key.value)]
                    problem = f"key {key.value!r} given twice in one mapping (lines {first} and {line})"
                    raise _DuplicateKey(None, None, problem, key.start_mark)
                seen[(key.tag, key.value)] = line
        return super().construct_mapping(node, deep=deep)


def _as_written(base: Callable[[yaml.SafeLoader, yaml.ScalarNode], Any]) -> Callable[[_Loader, yaml.ScalarNode], Any]:
    """A YAML 1.1 scalar that kubectl reads as the string it is: a time (``2026-01-01T10:00:00Z``), or a number in
    base 60 (``1:30``). Kubernetes' YAML reader (sigs.k8s.io/yaml, a fork of go-yaml v2) has no base-60 numbers and
    keeps timestamps as strings when decoding into JSON; PyYAML would turn them into 90 or a datetime, and the
    document written back would say something else."""

    def construct(loader: _Loader, node: yaml.ScalarNode) -> Any:
        if node.tag == "tag:yaml.org,2002:timestamp" or ":" in str(node.value):
            return loader.construct_scalar(node)
        return base(loader, node)

    return construct


_Loader.add_constructor("tag:yaml.org,2002:timestamp", _as_written(yaml.SafeLoader.construct_yaml_timestamp))
_Loader.add_constructor("tag:yaml.org,2002:int", _as_written(yaml.SafeLoader.construct_yaml_int))
_Loader.add_constructor("tag:yaml.org,2002:float", _as_written(yaml.SafeLoader.construct_yaml_float))


def dump(obj: Obj) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=2**16, allow_unicode=True)


def _metadata(obj: Obj) -> Obj:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _describe(obj: Obj) -> str:
    metadata = _metadata(obj)
    name = "/".join(str(part) for part in (metadata.get("namespace"), metadata.get("name")) if part)
    return f"{obj.get('kind')} {name}".strip()


def _load(document: Document) -> Obj | None:
    """The object a document holds; None for one of comments and directives only (``%YAML`` before a ``---``)."""
    if all(_COMMENT.fullmatch(line) for line in document.text.splitlines(keepends=True)):
        return None
    try:
        obj = yaml.load(document.text, Loader=_Loader)  # _Loader is a SafeLoader
    except _DuplicateKey as error:
        raise InjectError(f"{document.name}: {error.problem}; keep one (kubectl refuses it too)") from None
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise InjectError(f"{document.name}: not YAML: {problem}") from None
    except ValueError as error:  # a scalar that looks like a date and is not one: 2026-13-40
        raise InjectError(f"{document.name}: not YAML: {error}") from None
    except RecursionError:
        raise InjectError(f"{document.name}: nested too deeply to read") from None
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise InjectError(f"{document.name}: not a Kubernetes object but a {type(obj).__name__}")
    if not isinstance(obj.get("apiVersion"), str) or not isinstance(obj.get("kind"), str):
        raise InjectError(f"{document.name}: not a Kubernetes object (no apiVersion and kind)")
    return obj


def _rewrite(document: Document, obj: Obj) -> str:
    """The document's leading and trailing comment lines around a fresh dump of ``obj``."""
    lines = document.text.splitlines(keepends=True)
    head = 0
    while head < len(lines) and _COMMENT.fullmatch(lines[head]):
        head += 1
    tail = len(lines)
    while tail > head and _COMMENT.fullmatch(lines[tail - 1]):
        tail -= 1
    newline = "\r\n" if "\r\n" in document.text else "\n"
    # `--- {inline: document}`: the marker line holds content, so it goes, and a bare marker takes its place.
    before = "".join(lines[:head]) if head else ("---" + newline if document.text.startswith("---") else "")
    return before + dump(obj).replace("\n", newline) + "".join(lines[tail:])


ObjectId = tuple[str, str | None, str]  # kind, namespace, name


@dataclass(frozen=True)
class Injected:
    text: str
    pods: list[PodResult]  # every pod spec of a valid workload, injected or not
    containers: set[str]  # every container name seen in a workload
    # Each PodDisruptionBudget in the input: does it say unhealthyPodEvictionPolicy: AlwaysAllow
    budgets: dict[str, bool]
    invalid: list[str]  # "document 2 (line 9), Deployment x: spec.selector is missing: ...", each left as it was
    present: set[ObjectId]  # every object of the input

    @property
    def changed(self) -> list[str]:
        """Where the sidecar was added: "Deployment inference/vllm spec.template.spec", one per pod spec."""
        return [pod.where for pod in self.pods if pod.outcome.injected]


def _identity(obj: Obj) -> ObjectId:
    metadata = _metadata(obj)
    namespace = metadata.get("namespace")
    return str(obj.get("kind")), str(namespace) if namespace else None, str(metadata.get("name"))


def inject_text(text: str, options: Options) -> Injected:
    """Inject into every valid workload of a YAML stream; raises InjectError naming the first document it cannot
    read. An object that lacks a required field is left as it is, and named in ``invalid``."""
    parts: list[str] = []
    injected = Injected("", [], set(), {}, [], set())
    for document in split_documents(text):
        obj = _load(document)
        if obj is None:
            parts.append(document.text)
            continue
        items = obj["items"] if isinstance(obj.get("items"), list) else [obj]
        injected.present.update(_identity(each) for each in items if isinstance(each, dict))
        for budget in (each for each in items if isinstance(each, dict) and each.get("kind") == "PodDisruptionBudget"):
            injected.budgets[_describe(budget)] = section(budget, "spec", "spec").get(POLICY) == ALWAYS_ALLOW
        invalid = [f"{document.name}, {problem}" for problem in invalid_fields(obj)]
        injected.invalid.extend(invalid)
        edited = copy.deepcopy(obj)
        pods: list[PodResult] = []
        if not invalid:
            try:
                pods = inject_into(edited, options)
                injected.containers.update(container_names(obj))
            except InjectError as error:
                raise InjectError(f"{document.name}, {_describe(obj)}: {error}") from None
        parts.append(_rewrite(document, edited) if any(p.outcome.injected for p in pods) else document.text)
        injected.pods.extend(pods)
    if not injected.present:
        raise InjectError("the input holds no Kubernetes object")
    return dataclasses.replace(injected, text="".join(parts))


def documents(objects: list[Obj], *, after: str) -> str:
    """``objects`` as YAML documents to append to the stream ``after``; empty for none."""
    if not objects:
        return ""
    newline = "\r\n" if "\r\n" in after else "\n"
    start = "" if not after or after.endswith(("\n", "\r")) else newline
    return start + "".join(("---" + newline + dump(obj).replace("\n", newline)) for obj in objects)
