"""The hermes parser's rules, replayed: what is held back, when a call is named, what its arguments' deltas are.

Each case is a rule of vllm/tool_parsers/hermes_tool_parser.py (vLLM 0.32) that the transcripts' tokens never
reach: tags split across deltas, a call named before its arguments, a stream that ends inside a call.
"""

from __future__ import annotations

import itertools
import json

from hypothesis import given
from hypothesis import strategies as st

from gateway.tool_calls import Hermes, call_arguments, call_jsons, tag_overlap, tool_call_id

CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}\n</tool_call>'


def named() -> Hermes:
    numbers = itertools.count()
    return Hermes(new_id=lambda: f"call-{next(numbers)}")


def test_text_that_may_begin_a_call_is_held_back_until_it_does_not() -> None:
    hermes = named()
    assert hermes.feed("Let me <tool") == {"content": "Let me "}
    assert hermes.feed("Let me <tools are") == {"content": "<tools are"}


def test_a_call_is_named_once_its_name_is_whole_with_an_id_then_its_arguments_follow() -> None:
    hermes = named()
    assert hermes.feed('<tool_call>\n{"name": "get_ti') is None
    assert hermes.feed('<tool_call>\n{"name": "get_time", ') == {
        "content": None,
        "tool_calls": [{"id": "call-0", "type": "function", "index": 0, "function": {"name": "get_time"}}],
    }
    assert hermes.feed('<tool_call>\n{"name": "get_time", "arguments": {"zo') == {
        "content": None,
        "tool_calls": [{"index": 0, "function": {"arguments": '{"zo'}}],
    }


def test_a_whole_call_sends_its_arguments_without_the_brace_that_closes_the_call() -> None:
    assert call_jsons(CALL) == [('{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}', True)]
    assert call_arguments(call_jsons(CALL)[0][0], True) == '{"zone": "Asia/Tokyo"}'
    # A closing tag split across deltas is not part of the JSON.
    assert call_jsons(CALL[:-5]) == [('{"name": "get_time", "arguments": {"zone": "Asia/Tokyo"}}', True)]


def test_a_second_call_waits_for_the_first_to_be_named() -> None:
    hermes = named()
    text = '<tool_call>\n{"na' + "</tool_call>\n" + CALL
    assert hermes.feed(text) is None
    assert hermes.names == [None]


def test_a_call_with_no_arguments_yet_ends_with_an_empty_object() -> None:
    hermes = named()
    hermes.feed('<tool_call>\n{"name": "get_time"')
    assert hermes.unstreamed() == "{}"
    hermes.feed(CALL)
    assert hermes.unstreamed() == ""


def test_ids_look_like_vllms() -> None:
    made = tool_call_id()
    assert made.startswith("chatcmpl-tool-")
    assert len(made) == len("chatcmpl-tool-") + 16
    assert made != tool_call_id()


@given(st.lists(st.integers(min_value=0, max_value=len(CALL)), max_size=12))
def test_a_call_fed_in_any_pieces_adds_up_to_its_name_and_arguments(cuts: list[int]) -> None:
    hermes = named()
    deltas = [hermes.feed(CALL[:end]) for end in [*sorted(cuts), len(CALL)]]
    calls = [c for d in deltas if d for c in d.get("tool_calls") or ()]
    assert [c["function"]["name"] for c in calls if "id" in c] == ["get_time"]
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    assert json.loads(arguments) == {"zone": "Asia/Tokyo"}
    assert not any(d and d.get("content") for d in deltas)


def test_tag_overlap_is_the_longest_start_of_the_tag_ending_the_text() -> None:
    assert tag_overlap("abc<tool_", "<tool_call>") == 6
    assert tag_overlap("abc", "<tool_call>") == 0
    assert tag_overlap("<tool_call>", "<tool_call>") == 0  # a whole tag is not a partial one
