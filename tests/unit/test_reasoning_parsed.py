"""A parsed chat's continuation chunks, turned into the chat's, and which parsed chats the gateway continues.

The chunks are the thinking model's transcripts as tokens (tests/unit/test_reasoning.py), as /v1/completions streams
them and gateway.reshape turns them into chat chunks; the oracle is the replay of the whole stream, which real vLLM's
own deltas equal (tests/engines/test_reasoning_frames.py).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from gateway.continuation import continuation, refusal
from gateway.parsed import Replayed, markers_from, parser_refusal, skips_special_tokens, supported
from gateway.reasoning import ChatParsers, Markers, Piece, assembled, reasoning_tokens
from gateway.reshape import as_chat
from gateway.settings import ParserSettings, add_arguments, from_arguments
from gateway.splice import Splicer
from gateway.tool_calls import Delta
from simulate.vllm.transcripts import TRANSCRIPTS
from tests.unit.test_reasoning import PROMPT, QWEN3_HERMES, R1_HERMES, THINK, counter, tokens, whole, without_ids

R1 = ParserSettings("deepseek_r1", "hermes")
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]


def completion(piece: Piece, finish: str | None) -> dict[str, Any]:
    """The completions chunk vLLM streams for ``piece``."""
    choice = {"index": 0, "text": piece.text, "logprobs": None, "finish_reason": finish, "token_ids": list(piece.ids)}
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}


def chunk(piece: Piece, finish: str | None) -> dict[str, Any]:
    """The completions chunk for ``piece``, as the chat chunk gateway.reshape makes of it."""
    return as_chat(completion(piece, finish), top_logprobs=0)


def continued_chunks(parsers: ChatParsers, pieces: list[Piece], cut: int) -> tuple[list[Delta | None], Replayed]:
    before = Piece("".join(p.text for p in pieces[:cut]), tuple(i for p in pieces[:cut] for i in p.ids))
    replayed = Replayed.after(parsers, PROMPT, before)
    replayed.replay.new_id = replayed.replay.hermes.new_id = counter()
    out: list[Delta | None] = []
    for i, piece in enumerate(pieces[cut:], start=cut):
        choice = chunk(piece, "stop" if i == len(pieces) - 1 else None)["choices"][0]
        sends = replayed.chunk(choice, repeated=0, with_ids=False)
        out.append(choice["delta"] if sends else None)
        if choice["finish_reason"] is not None:
            out.append({"finish_reason": choice["finish_reason"]})
    return out, replayed


@pytest.mark.parametrize("parsers", [R1_HERMES, QWEN3_HERMES], ids=["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("t", TRANSCRIPTS, ids=[t.name for t in TRANSCRIPTS])
def test_continued_chunks_add_up_to_the_whole_message_with_its_finish_and_reasoning_count(
    parsers: ChatParsers, t: object
) -> None:
    transcript = next(x for x in TRANSCRIPTS if x is t)
    pieces = tokens(transcript.completion, [3, 17, 40, 41, 99])
    want = whole(parsers, pieces)
    ids = [i for p in pieces for i in p.ids]
    for cut in range(1, len(pieces)):
        got, replayed = continued_chunks(parsers, pieces, cut)
        finishes = [d.pop("finish_reason") for d in got if d and "finish_reason" in d]
        assert finishes == ["tool_calls" if transcript.calls else "stop"], cut
        got = [d for d in got if d != {}]
        assert without_ids(assembled([*want[:cut], *got])) == without_ids(assembled(want)), cut
        # A call begun before the cut keeps the id the client has: the continuation never names it again.
        named = [c["index"] for d in [*want[:cut], *got] if d for c in d.get("tool_calls") or () if "id" in c]
        assert named == list(range(len(transcript.calls))), cut
        usage = replayed.usage({"completion_tokens": len(ids)})
        assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens(parsers, ids)}


def test_a_token_vllm_sends_no_delta_for_goes_out_only_with_ids() -> None:
    replayed = Replayed.after(R1_HERMES, PROMPT, Piece("I think", (5, 6)))
    end = chunk(Piece("</think>", (THINK.think_end,)), None)["choices"][0]
    assert replayed.chunk(end, repeated=0, with_ids=False) is False
    assert end["delta"] == {}
    again = Replayed.after(R1_HERMES, PROMPT, Piece("I think", (5, 6)))
    assert again.chunk(chunk(Piece("</think>", (THINK.think_end,)), None)["choices"][0], repeated=0, with_ids=True)
    text = chunk(Piece("Yes", (9,)), None)["choices"][0]
    assert replayed.chunk(text, repeated=0, with_ids=False) is True
    assert text["delta"] == {"content": "Yes"}


def test_tokens_the_client_had_are_fed_to_the_parsers_and_not_sent_again() -> None:
    # " caf" + "\xc3" were sent before the break, the second with no text; the continuation starts after " caf".
    replayed = Replayed.after(R1_HERMES, PROMPT, Piece(" caf", (5,)))
    again = chunk(Piece("", (6,)), None)["choices"][0]
    assert replayed.chunk(again, repeated=1, with_ids=True) is False
    rest = chunk(Piece("é", (7, 8)), None)["choices"][0]
    assert replayed.chunk(rest, repeated=1, with_ids=True) is True
    assert rest["token_ids"] == [8]
    assert rest["delta"] == {"reasoning": "é"}
    assert replayed.generated == [5, 6, 7, 8]


def test_the_markers_come_from_tokenize_or_not_at_all() -> None:
    assert markers_from([700, 701], [1, 2]) == Markers(700, 701, frozenset({1, 2}))
    assert markers_from([700, 701], [5, 9, 1, 6, 2]) == Markers(700, 701, frozenset())  # no ChatML tokens
    assert markers_from([700, 5, 9, 701]) is None  # a vocabulary without a <think> token


def parser_settings(*flags: str) -> ParserSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_arguments(parser.parse_args(["--backend", "http://127.0.0.1:1", *flags])).parsers


def test_the_gateway_is_told_the_backends_parsers_by_flags_mirroring_vllms() -> None:
    assert parser_settings() == ParserSettings(None, None)
    flags = ("--reasoning-parser", "qwen3", "--tool-call-parser", "hermes")
    assert parser_settings(*flags) == ParserSettings("qwen3", "hermes")
    assert supported(ParserSettings("qwen3", "hermes"))
    assert supported(ParserSettings(None, "hermes"))
    assert not supported(ParserSettings("granite", "hermes"))
    assert not supported(ParserSettings(None, None))


@pytest.mark.parametrize(
    ("parsers", "seen", "body", "reason"),
    [
        (ParserSettings(None, None), "reasoning", {}, "reasoning"),  # parsers not known: cut as before
        (ParserSettings(None, None), "tools", {"tools": TOOLS}, "tool_call"),
        (R1, "reasoning", {}, None),
        (R1, "tools", {"tools": TOOLS}, None),
        (ParserSettings("qwen3", None), "reasoning", {}, None),
        (ParserSettings("granite", "hermes"), "reasoning", {}, "reasoning"),  # no replay for it
        (ParserSettings("granite", "hermes"), "tools", {"tools": TOOLS}, "tool_call"),
        (ParserSettings("deepseek_r1", "mistral"), "tools", {"tools": TOOLS}, "tool_call"),
        (ParserSettings("deepseek_r1", "mistral"), "", {"tools": TOOLS}, "tool_call"),  # a call may come next
        (R1, "reasoning", {"include_reasoning": False}, "reasoning_hidden"),
        (R1, "", {"tools": TOOLS, "tool_choice": "required"}, "guided"),
        (R1, "", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "guided"),
        (R1, "reasoning", {"response_format": {"type": "json_object"}}, "guided"),
    ],
)
def test_a_parsed_chat_is_cut_only_where_its_parsers_cannot_be_replayed(
    parsers: ParserSettings, seen: str, body: dict[str, object], reason: str | None
) -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.reasoning, splicer.tool_call = seen == "reasoning", seen == "tools"
    splicer.tokens = splicer.shown = 3
    splicer.prompt_token_ids = [1, 2]  # and token ids: it continues by ids
    assert refusal({"messages": [], **body}, splicer, chat=True, max_tokens=100, parsers=parsers) == reason


def test_a_parsed_chat_without_its_ids_is_cut_not_continued_by_its_content_alone() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.reasoning = True
    splicer.tokens = splicer.shown = 3
    splicer.token_ids = None  # a backend that returned no ids
    assert refusal({"messages": []}, splicer, chat=True, max_tokens=100, parsers=R1) == "reasoning"
    splicer.reasoning, splicer.tool_call = False, True
    assert refusal({"messages": []}, splicer, chat=True, max_tokens=100, parsers=R1) == "tool_call"


def test_a_completion_that_somehow_carries_reasoning_is_still_cut() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.reasoning = True
    assert refusal({"prompt": "x"}, splicer, chat=False, max_tokens=100, parsers=R1) == "reasoning"
    assert parser_refusal({}, R1, reasoning=True, tools=False) is None


def test_the_continuation_keeps_the_markers_in_its_text_where_the_chat_did() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.prompt_token_ids = [1, 2]
    splicer.token_ids.extend([5, 6])  # type: ignore[union-attr]
    splicer.tokens = splicer.shown = splicer.resume_ids = 2
    body = {"messages": [], "max_tokens": 10, "tools": TOOLS}
    plan = continuation(body, splicer, chat=True, path="/v1/chat/completions", parsers=R1)
    assert plan.body["skip_special_tokens"] is False
    assert plan.body["prompt"] == [1, 2, 5, 6]
    assert skips_special_tokens({"messages": []}, R1)  # deepseek_r1 without tools leaves it as asked
    assert not skips_special_tokens({"messages": []}, ParserSettings("qwen3", None))
    plain = continuation({"messages": [], "max_tokens": 10}, splicer, chat=True, path="/v1/chat/completions")
    assert "skip_special_tokens" not in plain.body


def test_the_splicer_sends_a_continued_parsed_chat_as_the_chat_with_its_finish_and_reasoning_usage() -> None:
    transcript = TRANSCRIPTS[4]
    pieces = tokens(transcript.completion, [5, 50])
    deltas = whole(R1_HERMES, pieces)
    splicer = Splicer(chat=True, include_usage=True, hide_ids=True)
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    out = [splicer.accept(json.dumps({**first, "prompt_token_ids": list(PROMPT)}).encode()).out]
    cut = len(pieces) // 2
    for piece, delta in zip(pieces[:cut], deltas[:cut], strict=True):
        choice = {"index": 0, "delta": delta or {}, "finish_reason": None, "token_ids": list(piece.ids)}
        out.append(splicer.accept(json.dumps({**head, "choices": [choice]}).encode()).out)
    splicer.next_segment(source_chat=False)
    before = Piece("".join(p.text for p in pieces[:cut]), tuple(i for p in pieces[:cut] for i in p.ids))
    splicer.replayed = Replayed.after(R1_HERMES, PROMPT, before)
    continued = len(out)
    for i, piece in enumerate(pieces[cut:], start=cut):
        raw = completion(piece, "stop" if i == len(pieces) - 1 else None)
        out.append(splicer.accept(json.dumps(raw).encode()).out)
    ids = [i for p in pieces for i in p.ids]
    usage = {
        "prompt_tokens": 9,
        "total_tokens": 9 + len(ids) - len(before.ids),
        "completion_tokens": len(ids) - len(before.ids),
    }
    splicer.accept(json.dumps({**head, "choices": [], "usage": usage}).encode())
    out.append(splicer.tail())
    events = [json.loads(line[6:]) for line in b"".join(out).decode().split("\n\n") if line.startswith("data: {")]
    sent = [c["delta"] for e in events for c in e["choices"]][1:]
    got = assembled(sent)
    assert without_ids(got) == without_ids(assembled(deltas))
    assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["tool_calls"]
    assert {c.get("token_ids") for e in events for c in e["choices"]} == {None}  # the client asked for none
    rest = [json.loads(line[6:]) for line in b"".join(out[continued:]).decode().split("\n\n") if line[6:7] == "{"]
    # No chunk without a delta: vLLM sends those only to a client that asked for token ids.
    assert not any(c["delta"] == {} and not c.get("finish_reason") for e in rest for c in e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == len(ids)
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens(R1_HERMES, ids)}
