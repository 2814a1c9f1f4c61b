"""A reasoning chat cut anywhere and continued from plain text adds up to the message the whole stream gives.

The streams are the thinking model's transcripts (simulate/vllm/transcripts.py), cut into tokens at places chosen
by hypothesis (each marker a token of its own, as in the model's vocabulary), so every way a tokenizer and a stream
could split them is tried; the oracle is the transcript itself: its reasoning, its content and its calls.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.reasoning import (
    ChatParsers,
    ChatReplay,
    Markers,
    Piece,
    assembled,
    continued,
    finish_reason,
    reasoning_open,
    reasoning_tokens,
)
from gateway.tool_calls import Delta
from simulate.vllm.transcripts import MARKERS, TRANSCRIPTS, Transcript

IDS = {marker: 1000 + i for i, marker in enumerate(MARKERS)}
THINK = Markers(think_start=IDS["<think>"], think_end=IDS["</think>"], turn_boundaries=frozenset({7}))
PROMPT = (7, 11, 12, IDS["<think>"], 13)  # the template's "<|im_start|>assistant\n<think>\n"
R1_HERMES = ChatParsers("deepseek_r1", "hermes", THINK)
QWEN3_HERMES = ChatParsers("qwen3", "hermes", THINK)


def tokens(text: str, cuts: list[int]) -> list[Piece]:
    """``text`` as tokens: each marker one, the text between cut at ``cuts`` (offsets into it, any number)."""
    out: list[Piece] = []
    rest = text
    while rest:
        at, marker = min(((rest.find(m), m) for m in MARKERS if m in rest), default=(len(rest), ""))
        plain = rest[:at]
        inner = sorted({c % len(plain) for c in cuts if plain} | {0, len(plain)}) if plain else []
        out += [Piece(plain[a:b], (hash(plain[a:b]) % 900,)) for a, b in itertools.pairwise(inner) if b > a]
        if marker:
            out.append(Piece(marker, (IDS[marker],)))
        rest = rest[at + len(marker) :]
    return out


def grouped(pieces: list[Piece], sizes: list[int]) -> list[Piece]:
    """Tokens as a stream sends them: several in one delta where the engine batched them."""
    out, at, size = [], 0, iter(sizes or [1])
    while at < len(pieces):
        n = next(size, 1)
        group = pieces[at : at + n]
        out.append(Piece("".join(p.text for p in group), tuple(i for p in group for i in p.ids)))
        at += n
    return out


def counter() -> Callable[[], str]:
    numbers = itertools.count()
    return lambda: f"call-{next(numbers)}"


def expected(t: Transcript) -> Delta:
    calls = [{"index": i, "name": c.name, "arguments": json.dumps(c.arguments)} for i, c in enumerate(t.calls)]
    return {"content": t.content or None, "reasoning": t.reasoning, "tool_calls": calls}


def without_ids(message: Delta) -> Delta:
    return {**message, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in message["tool_calls"]]}


def whole(parsers: ChatParsers, pieces: list[Piece]) -> list[Delta | None]:
    replay = ChatReplay(parsers, PROMPT, new_id=counter())
    return [replay.feed(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]


stream_cuts = st.lists(st.integers(min_value=0, max_value=10_000), max_size=40)
batches = st.lists(st.integers(min_value=1, max_value=4), max_size=30)


@pytest.mark.parametrize("parsers", [R1_HERMES, QWEN3_HERMES], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("t", TRANSCRIPTS, ids=[t.name for t in TRANSCRIPTS])
@settings(max_examples=60, deadline=None)
@given(cuts=stream_cuts, sizes=batches, cut=st.integers(min_value=0, max_value=10_000))
def test_a_stream_cut_anywhere_adds_up_to_the_transcript(
    parsers: ChatParsers, t: Transcript, cuts: list[int], sizes: list[int], cut: int
) -> None:
    pieces = grouped(tokens(t.completion, cuts), sizes)
    cut %= len(pieces) + 1
    sent = whole(parsers, pieces)[:cut]
    rest, tools_streamed = continued(parsers, PROMPT, pieces[:cut], pieces[cut:], new_id=counter())
    message = assembled(sent + rest)
    assert without_ids(message) == expected(t)
    assert tools_streamed == bool(t.calls)
    assert finish_reason("stop", tools_streamed=tools_streamed) == ("tool_calls" if t.calls else "stop")
    # Each call is named once, in one delta with its id: none begun before the cut is named again after it.
    named = [c["index"] for d in sent + rest if d for c in d.get("tool_calls") or () if "id" in c]
    assert named == list(range(len(t.calls)))


@pytest.mark.parametrize("parsers", [R1_HERMES, QWEN3_HERMES], ids=["deepseek_r1", "qwen3"])
@settings(max_examples=40, deadline=None)
@given(cuts=stream_cuts, cut=st.integers(min_value=0, max_value=10_000))
def test_what_came_before_may_be_given_as_one_piece(parsers: ChatParsers, cuts: list[int], cut: int) -> None:
    pieces = tokens(TRANSCRIPTS[4].completion, cuts)
    cut %= len(pieces) + 1
    one = Piece("".join(p.text for p in pieces[:cut]), tuple(i for p in pieces[:cut] for i in p.ids))
    by_pieces = continued(parsers, PROMPT, pieces[:cut], pieces[cut:], new_id=counter())
    assert continued(parsers, PROMPT, [one] if cut else [], pieces[cut:], new_id=counter()) == by_pieces


def test_the_end_marker_alone_is_an_empty_delta_and_the_text_after_it_content() -> None:
    # Measured on vLLM 0.32 (tests/engines/test_reasoning_frames.py): "</think>" alone sends {} (token ids only).
    for parsers in (R1_HERMES, QWEN3_HERMES, ChatParsers("deepseek_r1", None, THINK)):
        replay = ChatReplay(parsers, PROMPT)
        assert replay.feed(Piece("Think", (1,))) == {"reasoning": "Think"}
        assert replay.feed(Piece("</think>", (THINK.think_end,))) is None
        assert replay.feed(Piece("\n\nSo", (2,))) == {"content": "\n\nSo"}


def test_an_end_inside_a_delta_splits_it_as_each_parser_does() -> None:
    piece = Piece("ok.</think>\n\nSo", (1, THINK.think_end, 2))
    r1 = ChatReplay(ChatParsers("deepseek_r1", None, THINK), PROMPT).feed(piece)
    assert r1 == {"content": "\n\nSo", "reasoning": "ok."}
    qwen3 = ChatReplay(ChatParsers("qwen3", None, THINK), PROMPT).feed(piece)
    assert qwen3 == {"content": "\n\nSo", "reasoning": "ok."}


def test_qwen3_waits_on_a_marker_split_across_deltas_and_deepseek_r1_does_not() -> None:
    qwen3 = ChatReplay(ChatParsers("qwen3", None, THINK), PROMPT)
    assert qwen3.feed(Piece("a </th", (1,))) == {"reasoning": "a "}
    assert qwen3.feed(Piece("ink>b", (2,))) == {"content": "b"}
    r1 = ChatReplay(ChatParsers("deepseek_r1", None, THINK), PROMPT)
    assert r1.feed(Piece("a </th", (1,))) == {"reasoning": "a </th"}
    assert r1.feed(Piece("ink>b", (2,))) == {"reasoning": "ink>b"}  # its end is the token id, not the text


def test_a_prompt_that_closed_the_reasoning_starts_in_the_content() -> None:
    closed = (*PROMPT, THINK.think_end, 14)
    assert not reasoning_open(R1_HERMES, closed)
    assert reasoning_open(R1_HERMES, PROMPT)
    # qwen3 looks back only to the turn's start: an earlier turn's </think> does not close this one.
    earlier = (THINK.think_end, 7, 11, 12)
    assert reasoning_open(QWEN3_HERMES, earlier)
    assert not reasoning_open(R1_HERMES, earlier)
    assert ChatReplay(R1_HERMES, closed).feed(Piece("Hi", (3,))) == {"content": "Hi"}


def test_a_request_without_tools_gets_the_call_text_as_content() -> None:
    t = TRANSCRIPTS[3]
    parsers = ChatParsers("deepseek_r1", "hermes", THINK, tools_offered=False)
    message = assembled(whole(parsers, tokens(t.completion, [3, 9])))
    assert message["content"] == t.completion.split("</think>")[1]
    assert message["tool_calls"] == []


def test_a_call_cut_before_its_arguments_gets_them_at_the_end() -> None:
    # ToolParser.get_remaining_unstreamed_args: a named call with no arguments yet ends with "{}".
    replay = ChatReplay(ChatParsers(None, "hermes"), PROMPT, new_id=counter())
    replay.feed(Piece('<tool_call>\n{"name": "get_time", ', (1,)))
    last = replay.feed(Piece('"x": 1}', (2,)), finished=True)
    assert last is None or "{}" not in json.dumps(last)
    named = ChatReplay(ChatParsers(None, "hermes"), PROMPT, new_id=counter())
    first = named.feed(Piece('<tool_call>\n{"name": "get_time"', (1,)), finished=True)
    assert first == {
        "content": None,
        "tool_calls": [
            {"id": "call-0", "type": "function", "index": 0, "function": {"name": "get_time", "arguments": "{}"}}
        ],
    }


def test_reasoning_tokens_as_each_parser_counts_them() -> None:
    generated = [1, 2, 3, THINK.think_end, 4]
    assert reasoning_tokens(QWEN3_HERMES, generated) == 3
    assert reasoning_tokens(R1_HERMES, generated) == 0  # <think> was the prompt's
    assert reasoning_tokens(R1_HERMES, [THINK.think_start, 1, 2, THINK.think_end, 4]) == 2


def test_unknown_parsers_are_refused() -> None:
    with pytest.raises(ValueError, match="no replay"):
        ChatParsers("granite", None, THINK)
    with pytest.raises(ValueError, match="markers"):
        ChatParsers("qwen3", "hermes")
