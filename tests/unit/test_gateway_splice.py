"""The splicer and the continuation rules, on chunks in vLLM's shapes: pure, no servers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.continuation import Continuation, continuation, refusal, refusal_at_start, remaining_tokens
from gateway.ends import Broken, Finished
from gateway.splice import Splicer

CHAT = "/v1/chat/completions"


def chat_chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None, **top: Any) -> bytes:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    chunk = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return json.dumps({**chunk, **top}).encode()


def text_chunk(text: str, *, finish: str | None = None, ids: list[int] | None = None, **top: Any) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    if ids is not None:
        choice["token_ids"] = ids
    chunk = {"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return json.dumps({**chunk, **top}).encode()


def relayed(out: bytes) -> dict[str, Any]:
    assert out.startswith(b"data: ")
    assert out.endswith(b"\n\n")
    parsed: dict[str, Any] = json.loads(out[6:])
    return parsed


def test_the_first_backends_chunks_pass_through_byte_for_byte() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    data = text_chunk(" a")
    assert splicer.accept(data).out == b"data: " + data + b"\n\n"


def test_a_continuation_speaks_with_the_first_backends_id_created_and_model_and_one_role() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.accept(chat_chunk("", role="assistant"))
    splicer.accept(chat_chunk(" a"))
    splicer.next_segment()
    other: dict[str, Any] = {"id": "chatcmpl-b", "created": 9, "model": "other"}
    assert splicer.accept(chat_chunk("", role="assistant", **other)).out == b""
    out = relayed(splicer.accept(chat_chunk(" b", **other)).out)
    assert (out["id"], out["created"], out["model"]) == ("chatcmpl-a", 1, "m")
    assert splicer.text_so_far == " a b"


def test_finish_then_done_is_whole_and_done_alone_is_not() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    assert splicer.accept(b"[DONE]").end == Broken("reset", "[DONE] before a finish_reason")
    splicer.accept(text_chunk(" a", finish="length"))
    assert splicer.accept(b"[DONE]").end == Finished()


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"<html>", "garbage"),
        (b"[1, 2]", "garbage"),
        (b'{"error": {"message": "boom", "code": 500}}', "error_event"),
        (b'{"object": "error", "message": "old vLLM"}', "error_event"),
        (text_chunk("", finish="abort"), "abort"),
        (b'{"id": "x"}', "garbage"),
    ],
)
def test_what_breaks_a_backend_stream(data: bytes, cause: str) -> None:
    step = Splicer(chat=False, include_usage=False).accept(data)
    assert isinstance(step.end, Broken)
    assert step.end.cause == cause


@given(st.binary(max_size=300))
def test_any_event_bytes_give_an_answer_never_an_exception(data: bytes) -> None:
    Splicer(chat=True, include_usage=True).accept(data)


def test_text_with_lone_surrogates_is_kept_as_it_came() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(b'{"id": "x", "created": 1, "model": "m", "choices": [{"index": 0, "text": "a\\ud800"}]}')
    assert splicer.text_so_far == "a\ud800"


def test_a_chunk_only_json_reads_is_read_and_relayed_untouched() -> None:
    """A logprob of -Infinity (json's spelling of a float it cannot write otherwise) and an id past 64 bits."""
    splicer = Splicer(chat=False, include_usage=False)
    data = text_chunk(" a", ids=[2**70]).replace(b'"logprobs": null', b'"logprobs": {"token_logprobs": [-Infinity]}')
    step = splicer.accept(data)
    assert step.out == b"data: " + data + b"\n\n"
    assert splicer.text_so_far == " a"
    assert splicer.tokens == 1


def test_ids_that_are_no_8_byte_integers_are_left_out_and_the_rest_kept_in_order() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a", ids=[5]))
    splicer.accept(text_chunk(" b", ids=[6, 2**63, "7", 1.5, 8]))  # type: ignore[list-item]
    assert splicer.token_ids is not None
    assert list(splicer.token_ids) == [5, 6, 8]
    assert splicer.tokens == 6


@pytest.mark.parametrize("depth", [10, 100_000])
def test_a_chunk_nested_past_any_parser_is_garbage(depth: int) -> None:
    step = Splicer(chat=False, include_usage=False).accept(b"[" * depth + b"]" * depth)
    assert isinstance(step.end, Broken)
    assert step.end.cause == "garbage"


def test_usage_after_a_continuation_counts_the_original_prompt_and_every_token_received() -> None:
    splicer = Splicer(chat=False, include_usage=True)
    for piece in (" a", " b", " c"):
        splicer.accept(text_chunk(piece))
    splicer.next_segment()
    splicer.accept(text_chunk(" d", finish="length"))
    usage_chunk = {"id": "cmpl-b", "object": "text_completion", "created": 2, "model": "m", "choices": []}
    usage_chunk["usage"] = {"prompt_tokens": 8, "total_tokens": 9, "completion_tokens": 1}
    splicer.accept(json.dumps(usage_chunk).encode())
    tail = splicer.tail()
    assert tail.endswith(b"data: [DONE]\n\n")
    usage = relayed(tail.split(b"\n\n")[0] + b"\n\n")
    assert usage["id"] == "cmpl-a"
    assert usage["usage"] == {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}


def test_without_a_continuation_the_backends_usage_chunk_is_relayed_as_it_came() -> None:
    splicer = Splicer(chat=False, include_usage=True)
    splicer.accept(text_chunk(" a", finish="length"))
    raw = b'{"id":"cmpl-a","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"x":1}}'
    splicer.accept(raw)
    assert splicer.tail() == b"data: " + raw + b"\n\ndata: [DONE]\n\n"


def test_a_completion_continues_with_prompt_and_text_and_fewer_tokens() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a"))
    splicer.accept(text_chunk(" b"))
    body = {"prompt": "hi", "max_tokens": 10, "min_tokens": 5}
    follow = continuation(body, splicer, chat=False, path="/v1/completions")
    assert follow == Continuation("/v1/completions", {"prompt": "hi a b", "max_tokens": 8, "min_tokens": 3}, "text")
    assert body["prompt"] == "hi"  # the original is left alone


def test_a_completion_continues_from_token_ids_when_the_backend_returned_them() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a", ids=[7]))
    splicer.accept(text_chunk(" b", ids=[8]))
    follow = continuation({"prompt": [1, 2]}, splicer, chat=False, path="/v1/completions")
    assert (follow.body["prompt"], follow.body["max_tokens"], follow.method) == ([1, 2, 7, 8], 16 - 2, "token_ids")


def test_a_merged_chunk_is_generated_again_and_its_text_not_sent_twice() -> None:
    """Its last token may start a character its text leaves out: the continuation starts before the chunk."""
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a", ids=[7]))
    splicer.accept(text_chunk(" b", ids=[8, 9]))
    splicer.next_segment()
    follow = continuation({"prompt": [1, 2]}, splicer, chat=False, path="/v1/completions")
    assert (follow.body["prompt"], follow.body["max_tokens"]) == ([1, 2, 7], 16 - 1)
    splicer.rewind()
    assert splicer.accept(text_chunk(" ", ids=[8])).out == b""  # had it
    out = json.loads(splicer.accept(text_chunk("bé", ids=[9, 10])).out.removeprefix(b"data: "))
    assert (out["choices"][0]["text"], out["choices"][0]["token_ids"]) == ("é", [10])
    assert (splicer.text_so_far, splicer.tokens, list(splicer.token_ids or ())) == (" a bé", 4, [7, 8, 9, 10])


def test_a_chat_without_ids_continues_as_a_final_assistant_message_or_extends_the_clients_own() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.accept(chat_chunk("", role="assistant"))
    splicer.accept(chat_chunk(" a"))
    user = [{"role": "user", "content": "hi"}]
    follow = continuation({"messages": user, "max_completion_tokens": 5}, splicer, chat=True, path=CHAT).body
    assert follow["messages"] == [*user, {"role": "assistant", "content": " a"}]
    assert (follow["continue_final_message"], follow["add_generation_prompt"]) == (True, False)
    assert follow["max_completion_tokens"] == 4
    prefilled = {"messages": [*user, {"role": "assistant", "content": "Sure:"}], "continue_final_message": True}
    follow = continuation(prefilled, splicer, chat=True, path=CHAT).body
    assert follow["messages"][-1] == {"role": "assistant", "content": "Sure: a"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"n": 2}, "multiple_choices"),
        ({"use_beam_search": True}, "multiple_choices"),
        ({"prompt": ["a", "b"]}, "multiple_choices"),
        ({"guided_regex": "a+"}, "guided"),
        ({"response_format": {"type": "json_schema"}}, "guided"),
        ({"response_format": {"type": "text"}}, None),
        ({"n": 1, "prompt": ["a"]}, None),
        ({"echo": True}, "unsupported_prompt"),
    ],
)
def test_requests_that_can_never_continue(body: dict[str, Any], reason: str | None) -> None:
    assert refusal_at_start(body, chat=False) == reason


def test_a_started_tool_call_or_a_long_text_stops_the_continuation() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.accept(chat_chunk(" a"))
    assert refusal({"messages": []}, splicer, chat=True, max_tokens=1) is None
    splicer.accept(chat_chunk(" b"))
    assert refusal({"messages": []}, splicer, chat=True, max_tokens=1) == "too_long"
    tool = {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}, "finish_reason": None}
    splicer.accept(json.dumps({"id": "x", "created": 1, "model": "m", "choices": [tool]}).encode())
    assert refusal({"messages": []}, splicer, chat=True, max_tokens=100) == "tool_call"


def test_token_id_prompts_without_generated_ids_cannot_continue() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a"))
    assert refusal({"prompt": [1, 2]}, splicer, chat=False, max_tokens=100) == "unsupported_prompt"


def test_remaining_tokens_follow_vllms_defaults() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.accept(chat_chunk(" a"))
    assert remaining_tokens({"messages": []}, splicer, chat=True) is None
    assert remaining_tokens({"max_tokens": 9, "max_completion_tokens": 4}, splicer, chat=True) == 3
    assert remaining_tokens({"prompt": "x"}, splicer, chat=False) == 15


def test_continuous_usage_on_a_continuations_chunks_counts_the_whole_stream() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a"))
    splicer.accept(text_chunk(" b"))
    splicer.next_segment()
    usage = {"prompt_tokens": 7, "total_tokens": 8, "completion_tokens": 1}
    out = relayed(splicer.accept(text_chunk(" c", usage=usage)).out)
    assert out["usage"] == {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}


def test_a_token_with_no_text_yet_on_the_abort_chunk_reaches_the_client_once() -> None:
    """vLLM's abort chunk may carry a token whose text is an incomplete character (empty text): the client must get
    its id, once, though the continuation generates it again."""
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(text_chunk(" a", ids=[7]))
    splicer.accept(text_chunk(" b", ids=[8]))
    step = splicer.accept(text_chunk("", ids=[9], finish="abort"))
    assert isinstance(step.end, Broken)
    out = relayed(step.out)["choices"][0]
    assert (out["text"], out["token_ids"], out["finish_reason"]) == ("", [9], None)
    splicer.next_segment()
    follow = continuation({"prompt": [1, 2]}, splicer, chat=False, path="/v1/completions")
    assert follow.body["prompt"] == [1, 2, 7, 8]  # from the last token with text: 9 comes again
    splicer.rewind()
    assert splicer.accept(text_chunk("", ids=[9])).out == b""  # had it
    out = relayed(splicer.accept(text_chunk("é", ids=[10])).out)["choices"][0]
    assert (out["text"], out["token_ids"]) == ("é", [10])
    assert list(splicer.token_ids or ()) == [7, 8, 9, 10]
