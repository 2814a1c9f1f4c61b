"""The RFC 6902 diff: applied (by the jsonpatch library, an independent implementation) to its input, the patch
gives exactly its output, JSON types included."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
from hypothesis import example, given
from hypothesis import strategies as st

from webhook.patch import diff, pointer, same

KEYS = st.text(alphabet="ab~/0-", max_size=3)  # the characters a JSON Pointer must escape, and digits
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from([0.0, 1.0, 1.5]) | st.text("xy", max_size=2),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=4),
    max_leaves=25,
)


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


@given(before=JSON, after=JSON)
@example(before={"a": [1, 2, 3]}, after={"a": [1]})
@example(before={"a": 1}, after={"a": True})
@example(before=[1.0], after=[1])
@example(before={"a/b": {"~": 1}}, after={"a/b": {"~": 2}, "": 0})
@example(before={"c": [{"x": 1}]}, after={"c": [{"x": 2}, {"y": 3}]})
def test_applying_the_patch_to_the_input_gives_the_output(before: Any, after: Any) -> None:
    patch = diff(copy.deepcopy(before), after)
    assert canonical(jsonpatch.apply_patch(copy.deepcopy(before), patch)) == canonical(after)


@given(value=JSON)
def test_a_document_compared_with_itself_needs_no_operation(value: Any) -> None:
    assert diff(value, copy.deepcopy(value)) == []


@given(before=JSON, after=JSON)
def test_the_diff_leaves_its_inputs_as_they_were(before: Any, after: Any) -> None:
    kept_before, kept_after = canonical(before), canonical(after)
    diff(before, after)
    assert (canonical(before), canonical(after)) == (kept_before, kept_after)


def test_an_appended_container_is_one_add_at_the_end_and_an_edited_one_is_patched_in_place() -> None:
    before = {"spec": {"containers": [{"name": "vllm", "image": "v"}]}}
    after = {"spec": {"containers": [{"name": "vllm", "image": "v", "lifecycle": {}}, {"name": "spotdrain"}]}}
    assert diff(before, after) == [
        {"op": "add", "path": "/spec/containers/0/lifecycle", "value": {}},
        {"op": "add", "path": "/spec/containers/1", "value": {"name": "spotdrain"}},
    ]


def test_pointers_escape_tilde_before_slash() -> None:
    assert pointer(["a/b", "~1", ""]) == "/a~1b/~01/"
    assert jsonpatch.JsonPointer(pointer(["a/b", "~1"])).parts == ["a/b", "~1"]


def test_json_equality_tells_booleans_and_floats_from_integers() -> None:
    assert not same(True, 1)
    assert not same([1.0], [1])
    assert same({"a": [1, {"b": None}]}, {"a": [1, {"b": None}]})
