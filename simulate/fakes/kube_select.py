"""Label and field selectors as the Kubernetes API server reads them, and the ``Status`` errors of the fake API.

Label selectors follow the ``labels.Parse`` grammar (``a=b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``,
``a notin (x)``, ``a>1``); field selectors accept only the field labels a resource supports, as the server does.
Pure functions: errors are ``KubeError`` with the HTTP status and reason the real server would answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


class KubeError(Exception):
    """An answer the API server gives as a ``Status`` object."""

    def __init__(self, code: int, reason: str, message: str, *, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = dict(details or {})

    def status(self) -> Obj:
        body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body |= {"message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            body["details"] = self.details
        return body


def bad_request(message: str) -> KubeError:
    return KubeError(400, "BadRequest", message)


# The API server reads boolean query parameters with Go's strconv.ParseBool (kubernetes-asyncio sends "True").
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})


def flag(query: Mapping[str, str], name: str) -> bool:
    return query.get(name, "") in _TRUE


_TOKEN = re.compile(r"\s*(!=|==|=|!|\(|\)|,|<|>|[^\s!=(),<>]+)")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}")
_VALUE = re.compile(rf"({_NAME})?")
_OPERATORS = {"In": "in", "NotIn": "notin", "Exists": "exists", "DoesNotExist": "!"}


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # exists, !, =, !=, in, notin, <, >
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.op in ("exists", "!"):
            return (value is not None) == (self.op == "exists")
        if self.op in ("!=", "notin"):
            return value not in self.values
        if self.op in ("<", ">"):
            if value is None or not re.fullmatch(r"-?\d+", value):
                return False
            return int(value) < int(self.values[0]) if self.op == "<" else int(value) > int(self.values[0])
        return value in self.values


def parse_label_selector(text: str) -> list[Requirement]:
    """Requirements joined by commas: ``a=b``, ``a!=b``, ``a``, ``!a``, ``a in (x,y)``, ``a notin (x)``, ``a>1``."""
    tokens, position = _tokenize(text), 0
    requirements: list[Requirement] = []
    while position < len(tokens):
        requirement, position = _requirement(tokens, position)
        requirements.append(requirement)
        if position < len(tokens):
            _expect(tokens, position, ",")
            position += 1
            if position == len(tokens):
                raise bad_request(f"unable to parse requirement: found '', expected an identifier in {text!r}")
    return requirements


def labels_match(requirements: Iterable[Requirement], labels: Mapping[str, str] | None) -> bool:
    return all(r.matches(labels or {}) for r in requirements)


def selector_requirements(selector: Mapping[str, Any] | None) -> list[Requirement] | None:
    """A LabelSelector object's requirements; None (a null selector) selects nothing, ``{}`` everything."""
    if selector is None:
        return None
    requirements = [Requirement(k, "=", (v,)) for k, v in (selector.get("matchLabels") or {}).items()]
    for expression in selector.get("matchExpressions") or []:
        if (op := _OPERATORS.get(expression.get("operator", ""))) is None:
            raise KubeError(422, "Invalid", f"{expression.get('operator')!r} is not a valid label selector operator")
        requirements.append(Requirement(expression.get("key", ""), op, tuple(expression.get("values") or ())))
    return requirements


def _tokenize(text: str) -> list[str]:
    tokens, position = [], 0
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            break  # only whitespace is left
        tokens.append(match.group(1))
        position = match.end()
    return tokens


def _requirement(tokens: list[str], at: int) -> tuple[Requirement, int]:
    if tokens[at] == "!":
        return Requirement(_key(tokens, at + 1), "!"), at + 2
    key, at = _key(tokens, at), at + 1
    op = tokens[at] if at < len(tokens) else ","
    if op == ",":
        return Requirement(key, "exists"), at
    if op in ("=", "==", "!="):
        op = "!=" if op == "!=" else "="
        if _is_separator(tokens, at + 1):
            return Requirement(key, op, ("",)), at + 1  # "a=" selects an empty value
        return Requirement(key, op, (_value(tokens[at + 1]),)), at + 2
    if op in ("<", ">"):
        number = tokens[at + 1] if at + 1 < len(tokens) else ""
        if not re.fullmatch(r"-?\d{1,18}", number):
            raise bad_request(f"unable to parse requirement: for {op!r}, {number!r} is not an integer")
        return Requirement(key, op, (number,)), at + 2
    if op in ("in", "notin"):
        values, at = _value_list(tokens, at + 1)
        return Requirement(key, op, values), at
    raise bad_request(f"unable to parse requirement: found {op!r}, expected: in, notin, =, ==, !=, gt, lt")


def _is_separator(tokens: list[str], at: int) -> bool:
    return at == len(tokens) or tokens[at] == ","


def _value_list(tokens: list[str], at: int) -> tuple[tuple[str, ...], int]:
    _expect(tokens, at, "(")
    values: list[str] = []
    at += 1
    while True:
        token = tokens[at] if at < len(tokens) else ""
        if token in (",", ")"):
            values.append("")  # "in (a,)" and "in ()" hold the empty value, as the real parser reads them
        else:
            values.append(_value(token))
            at += 1
            token = tokens[at] if at < len(tokens) else ""
        if token == ")":
            return tuple(values), at + 1
        _expect(tokens, at, ",")
        at += 1


def _expect(tokens: list[str], at: int, wanted: str) -> None:
    found = tokens[at] if at < len(tokens) else ""
    if found != wanted:
        raise bad_request(f"unable to parse requirement: found {found!r}, expected: {wanted!r}")


def _key(tokens: list[str], at: int) -> str:
    key = tokens[at] if at < len(tokens) else ""
    name = key.rpartition("/")[2]
    if not _KEY.fullmatch(key) or len(name) > 63:
        raise bad_request(f"unable to parse requirement: invalid label key {key!r}")
    return key


def _value(token: str) -> str:
    if not _VALUE.fullmatch(token) or len(token) > 63:
        raise bad_request(f"unable to parse requirement: invalid label value {token!r}")
    return token


_FIELD_PATHS = {"source": "source.component"}  # the field label differs from the JSON path
_FALSE_WHEN_MISSING = {"spec.unschedulable", "spec.hostNetwork"}


def parse_field_selector(text: str, supported: frozenset[str]) -> list[tuple[str, str, str]]:
    """``field=value``, ``field==value`` or ``field!=value`` terms joined by commas, as (field, op, value)."""
    terms = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        match = re.fullmatch(r"([^=!]+)(!=|==|=)(.*)", term)
        if match is None:
            raise bad_request(f"invalid selector: {text!r}; can't understand {term!r}")
        field, op, value = match.groups()
        if field not in supported:
            raise bad_request(f"field label not supported: {field}")
        terms.append((field, "!=" if op == "!=" else "=", value))
    return terms


def fields_match(terms: Iterable[tuple[str, str, str]], obj: Obj) -> bool:
    return all((field_value(obj, field) == value) == (op == "=") for field, op, value in terms)


def field_value(obj: Obj, field: str) -> str:
    value: Any = obj
    for part in _FIELD_PATHS.get(field, field).split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "false" if field in _FALSE_WHEN_MISSING else ""
    return str(value).lower() if isinstance(value, bool) else str(value)
