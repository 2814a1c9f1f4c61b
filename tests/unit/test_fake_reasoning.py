"""The fake engine's thinking model and the parsers' deltas it streams, as vLLM 0.32 streams them.

What real vLLM sends is recorded in tests/engines/test_reasoning_frames.py; tests/engines/test_fake_reasoning_frames.py
holds the fake's frames against it, shape for shape.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulate.fakes.openai_format import Stream
from simulate.fakes.reasoning_frames import ChatFrames, Parsers, _Calls, whole
from simulate.fakes.thinking import (
    END_OF_TURN,
    THINK_END,
    TOOL_START,
    Tool,
    continuation,
    read_tools,
    render,
    reply,
    reply_start,
    tools_of,
)
from simulate.fakes.tokens import MARKER_IDS, Detokenizer, text_of, tokenize

TOOLS = [Tool("get_weather", ("city", "unit")), Tool("get_time", ("zone",))]
REASONING = 30


def prompt(question: str, tools: list[Tool] | None = None) -> list[int]:
    return tokenize(render([{"role": "user", "content": question}], tools=tools or ()))


def frames(ids: list[int], parsers: Parsers, *, with_ids: bool = False) -> list[tuple[int, Any]]:
    """Each generated step's delta (None: no chunk), the text as the detokenizer gives it."""
    detokenizer = Detokenizer(skip_special=False)
    chat = ChatFrames(parsers, with_ids=with_ids)
    out = []
    for n, token in enumerate(ids):
        last = n == len(ids) - 1
        out.append((token, chat.delta(token, "" if token == END_OF_TURN else detokenizer.step(token), finished=last)))
    return out


def assembled(deltas: list[Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}}
    for delta in deltas:
        for key in ("reasoning", "content"):
            message[key] += (delta or {}).get(key) or ""
        for call in (delta or {}).get("tool_calls") or ():
            into = message["calls"].setdefault(call["index"], {"name": None, "arguments": "", "ids": 0})
            into["name"] = call.get("function", {}).get("name") or into["name"]
            into["arguments"] += call.get("function", {}).get("arguments") or ""
            into["ids"] += "id" in call
    return message


def test_the_markers_are_one_token_each_and_the_tool_signatures_read_back_from_the_prompt() -> None:
    assert tokenize("<think></think>") == [MARKER_IDS["<think>"], MARKER_IDS["</think>"]]
    assert len(tokenize("<tool_call>")) == 1
    ids = prompt("weather?", TOOLS)
    assert read_tools(ids) == TOOLS
    assert read_tools(prompt("weather?")) == []
    assert tools_of([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}}}}}]) == [
        Tool("f", ("a",))
    ]


def test_the_tool_call_markers_are_special_and_the_reasoning_ones_are_not() -> None:
    """As on Hermes 2 Pro's tokenizer: skip_special_tokens drops <tool_call> from the text, not </think>."""
    ids = tokenize("<think> amber</think><tool_call>")
    assert text_of(ids) == "<think> amber</think><tool_call>"
    assert text_of(ids, skip_special=True) == "<think> amber</think>"


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=40), st.booleans(), st.integers(min_value=0, max_value=400))
def test_a_reply_continues_exactly_from_the_prompt_and_any_number_of_its_ids(
    question: str, tools: bool, cut: int
) -> None:
    ids = prompt(question, TOOLS if tools else None)
    whole = reply(ids, reasoning_tokens=REASONING, partial_utf8=True)
    cut = min(cut, len(whole))
    assert reply_start(ids) == len(ids)
    so_far = ids + [s.token for s in whole[:cut]]
    assert continuation(so_far, reasoning_tokens=REASONING, partial_utf8=True) == whole[cut:]


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=40), st.booleans())
def test_a_reply_reasons_then_answers_then_calls_the_tools_offered(question: str, tools: bool) -> None:
    whole = reply(prompt(question, TOOLS if tools else None), reasoning_tokens=REASONING, partial_utf8=True)
    kinds = [s.kind for s in whole]
    assert kinds[:REASONING] == ["reasoning"] * REASONING
    assert whole[REASONING].token == THINK_END
    assert whole[-1].token == END_OF_TURN
    calls = {s.call for s in whole if s.kind == "call"}
    assert calls in ({0}, {0, 1}) if tools else calls == set()
    for index in calls:
        text = text_of([s.token for s in whole if s.call == index])
        body = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        assert any(body["name"] == t.name and set(body["arguments"]) == set(t.parameters) for t in TOOLS)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_deltas_add_up_to_the_reply_as_vllms_parsers_split_it(parser: str) -> None:
    found = set()
    for question in ("a", "b", "c", "d", "e", "f"):
        whole = reply(prompt(question, TOOLS), reasoning_tokens=REASONING, partial_utf8=True)
        ids = [s.token for s in whole]
        steps = frames(ids, Parsers(parser, "hermes", tools_offered=True))
        message = assembled([d for _, d in steps])
        end = ids.index(THINK_END)
        assert message["reasoning"] == text_of(ids[:end])
        reasoning = [d for _, d in steps[:end] if d is not None]
        assert all(list(d) == ["reasoning"] for d in reasoning)
        assert len(reasoning) == end if parser == "deepseek_r1" else len(reasoning) <= end  # qwen3: no empty ones
        assert message["content"] == text_of(ids[end + 1 : ids.index(TOOL_START)])
        assert [d for t, d in steps if t == THINK_END] == [None]  # sent as {} only where ids were asked
        for index, call in message["calls"].items():
            text = text_of([s.token for s in whole if s.call == index])
            body = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
            assert (call["name"], call["arguments"], call["ids"]) == (body["name"], json.dumps(body["arguments"]), 1)
        found.add(len(message["calls"]))
    assert found == {1, 2}


def test_reasoning_hidden_drops_it_and_every_chunks_ids() -> None:
    ids = [s.token for s in reply(prompt("a", TOOLS), reasoning_tokens=REASONING, partial_utf8=False)]
    hidden = frames(ids, Parsers("deepseek_r1", "hermes", tools_offered=True, include_reasoning=False))
    assert all(d is None for _, d in hidden[: REASONING + 1])
    assert all(d is None or d["reasoning"] is None for _, d in hidden)
    out = Stream(True, "chatcmpl-1", 0, "m", token_ids=True)
    chat = ChatFrames(Parsers("deepseek_r1", "hermes", True, include_reasoning=False), with_ids=True)
    assert chat.chunk(out, ids[0], " a", finish=None, stop=None, index=0) is None
    shown = ChatFrames(Parsers("deepseek_r1", "hermes", True), with_ids=True)
    chunk = shown.chunk(out, ids[0], " a", finish=None, stop=None, index=0)
    assert chunk is not None
    assert b'"token_ids":[' in chunk


def test_the_usage_counts_reasoning_tokens_as_each_parser_does() -> None:
    ids = [s.token for s in reply(prompt("a"), reasoning_tokens=REASONING, partial_utf8=True)]
    for parser, counted in (("deepseek_r1", 0), ("qwen3", REASONING)):  # deepseek_r1: <think> was the prompt's
        chat = ChatFrames(Parsers(parser, "hermes", tools_offered=False))
        for token in ids:
            chat.delta(token, "", finished=False)
        assert chat.reasoning_tokens() == counted


@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet=st.characters(blacklist_characters="<"), max_size=20),
    st.dictionaries(st.sampled_from(["city", "zone", "unit"]), st.text(max_size=8), max_size=3),
    st.lists(st.integers(min_value=1, max_value=80), max_size=12),
)
def test_hermes_names_a_call_once_then_streams_all_its_arguments_however_the_text_is_split(
    content: str, arguments: dict[str, str], splits: list[int]
) -> None:
    text = f"{content}<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': arguments})}\n</tool_call>"
    calls, deltas, at = _Calls(), [], 0
    for end in sorted({*splits, len(text)}):
        if end > at:
            deltas.append(calls.feed(text[:end]))
            at = end
    got = assembled(deltas)
    assert got["content"] == content
    assert got["calls"] == {0: {"name": "get_weather", "arguments": json.dumps(arguments), "ids": 1}}


def test_a_whole_chats_message_is_split_as_the_parsers_split_a_complete_output() -> None:
    parsers = Parsers("deepseek_r1", "hermes", tools_offered=True)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Lima"}}\n</tool_call>'
    got = whole(parsers, f" a b</think>\n\n answer\n{call}")
    assert (got["reasoning"], got["content"]) == (" a b", "\n\n answer\n")
    assert [c["function"] for c in got["tool_calls"]] == [{"name": "get_time", "arguments": '{"zone": "Lima"}'}]
    assert whole(parsers, f" a</think>\n\n{call}")["content"] is None  # only white space before the call
    assert whole(parsers, " still thinking") == {
        "content": None,
        "reasoning": " still thinking",
        "tool_calls": [],
        "hidden": False,
    }
    assert whole(Parsers("deepseek_r1", "hermes", tools_offered=False), f" a</think>{call}")["content"] == call
    hidden = whole(Parsers("qwen3", "hermes", tools_offered=True, include_reasoning=False), " a</think> b")
    assert (hidden["reasoning"], hidden["content"], hidden["hidden"]) == (None, " b", True)
