"""Which models a node should hold (its ``spotdrain.io/models`` annotation), and the label that shows each one."""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from agent.cache.fetch.sources import MirrorSource, S3Source
from agent.cache.models import MODELS_ANNOTATION, ModelState, Wanted, plan_model_label, wanted_models
from simulate.fakes.kube_patch import merge_patch

# Kubernetes' qualified name (apimachinery/pkg/util/validation): prefix/name, the name at most 63 characters.
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def wanted(text: str) -> tuple[list[Wanted], list[str]]:
    return wanted_models({MODELS_ANNOTATION: text})


def test_entries_separated_by_commas_or_whitespace_name_each_model_and_its_source() -> None:
    models, problems = wanted(
        "qwen=s3://models/qwen/,\n  llama=hf+https://mirror.internal/hub/meta/llama@v2 tiny=s3://m/t"
    )
    assert problems == []
    assert [(m.name, m.source) for m in models] == [
        ("qwen", S3Source("models", "qwen/")),
        ("llama", MirrorSource("https://mirror.internal/hub", "meta/llama", "v2")),
        ("tiny", S3Source("m", "t/")),
    ]
    assert models[0].label == "spotdrain.io/model.qwen"


def test_an_entry_that_cannot_be_a_model_is_a_problem_and_the_others_still_count() -> None:
    models, problems = wanted(
        "ok=s3://b/p/ noequals =s3://b/x/ .hidden=s3://b/h/ x=ftp://h/m ok=s3://b/other/ " + "n" * 58 + "=s3://b/l/"
    )
    assert [m.name for m in models] == ["ok"]
    assert len(problems) == 6
    assert any("named twice" in problem for problem in problems)


def test_a_node_without_the_annotation_or_with_another_type_wants_nothing() -> None:
    assert wanted_models({}) == ([], [])
    assert wanted_models({MODELS_ANNOTATION: 3}) == ([], [])


@given(st.text())
def test_any_annotation_gives_models_whose_labels_are_valid_and_never_raises(text: str) -> None:
    models, _ = wanted(text)
    for model in models:
        prefix, _, name = model.label.partition("/")
        assert prefix == "spotdrain.io"
        assert LABEL_NAME.fullmatch(name), model.label
        assert not model.name.startswith(".")


def node(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "gpu-1", "resourceVersion": "7", "labels": labels}}


def test_a_model_label_is_set_key_by_key_and_not_rewritten_when_it_has_that_value() -> None:
    model = Wanted("qwen", S3Source("models", "qwen/"))
    before = node({"team": "llm"})
    patch = plan_model_label(before, model, ModelState.FETCHING)
    assert patch == {"metadata": {"labels": {"spotdrain.io/model.qwen": "fetching"}}}
    after = merge_patch(before, patch)
    assert after["metadata"]["labels"] == {"team": "llm", "spotdrain.io/model.qwen": "fetching"}
    assert plan_model_label(after, model, ModelState.FETCHING) is None
    assert plan_model_label(after, model, ModelState.READY) == {
        "metadata": {"labels": {"spotdrain.io/model.qwen": "ready"}}
    }
