"""The gateway's own token ids, the continuation by ids, the chat reshaping and the stall bound: pure, no servers.

Chunk bytes are vLLM 0.32.0's as measured on the tiny model (field order and nulls included).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.backends import Mover, Pool
from gateway.continuation import COMPLETIONS, by_ids, continuation
from gateway.metrics import GatewayMetrics
from gateway.reshape import as_chat, chat_logprobs
from gateway.splice import Splicer
from gateway.stalls import STALL_MAX_S, STALL_MIN_S, stall_bound, stalled
from gateway.token_ids import FIELD, hide, hide_in, refuses_ids, with_ids
from spotdrain.metrics import CollectorRegistry

FIRST = (
    b'{"id":"cmpl-8f2f","object":"text_completion","created":1796163595,"model":"tiny","choices":[{"index":0,'
    b'"text":":","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":[564,489,503],'
    b'"token_ids":[31]}]}'
)
FIRST_WITHOUT_IDS = (
    b'{"id":"cmpl-8f2f","object":"text_completion","created":1796163595,"model":"tiny","choices":[{"index":0,'
    b'"text":":","logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
    b'"token_ids":null}]}'
)
CHAT_ROLE = (
    b'{"id":"chatcmpl-b0","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
    b'"prompt_token_ids":[3,287,81,81,84,535,2,4],"prompt_text":null}'
)


def completion(text: str, ids: list[int], *, finish: str | None = None, prompt: list[int] | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    choice |= {"prompt_token_ids": prompt, "token_ids": ids}
    chunk = {"id": "cmpl-a", "object": "text_completion", "created": 1, "model": "tiny", "choices": [choice]}
    return json.dumps(chunk, separators=(",", ":")).encode()


def chat(text: str, ids: list[int], *, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    choice["token_ids"] = ids
    chunk = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 1, "model": "tiny", "choices": [choice]}
    return json.dumps(chunk, separators=(",", ":")).encode()


def relayed(out: bytes) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(out.removeprefix(b"data: "))
    return parsed


def test_hidden_ids_leave_exactly_the_chunk_vllm_sends_a_client_that_did_not_ask() -> None:
    assert hide(FIRST) == FIRST_WITHOUT_IDS
    assert hide(FIRST_WITHOUT_IDS) is FIRST_WITHOUT_IDS  # nothing to hide: the same bytes, not a copy
    assert json.loads(hide(CHAT_ROLE))["prompt_token_ids"] is None
    other = b'{"choices":[{"index":0,"text":"","stop_token_ids":[2],"token_ids":[7]}]}'
    assert hide(other) == b'{"choices":[{"index":0,"text":"","stop_token_ids":[2],"token_ids":null}]}'


@given(
    text=st.text(),
    ids=st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=5),
    spaced=st.booleans(),
)
def test_hiding_on_bytes_and_on_the_parsed_chunk_agree_whatever_the_text_holds(
    text: str, ids: list[int], spaced: bool
) -> None:
    # A text that looks like the field (quotes in JSON strings are escaped) must stay as it is.
    text = text + '","token_ids":[1]' if len(text) % 2 else text
    chunk = json.loads(completion(text, ids, prompt=ids))
    data = json.dumps(chunk, separators=(", ", ": ") if spaced else (",", ":")).encode()
    hide_in(chunk)
    assert json.loads(hide(data)) == chunk
    assert json.loads(hide(data))["choices"][0]["text"] == text


@pytest.mark.parametrize(
    ("status", "body", "refused"),
    [
        (400, b'{"error": {"message": "return_token_ids: extra inputs are not permitted"}}', True),
        (422, b"Failed to deserialize the JSON body: unknown field `return_token_ids`", True),
        (400, b'{"error": {"message": "max_tokens must be at least 1"}}', False),
        (404, b"return_token_ids", False),
    ],
)
def test_a_refusal_of_the_field_is_a_4xx_that_names_it(status: int, body: bytes, refused: bool) -> None:
    assert refuses_ids(status, body) is refused


def test_every_id_is_a_token_and_empty_text_chunks_count() -> None:
    splicer = Splicer(chat=False, include_usage=True)
    splicer.accept(FIRST)
    splicer.accept(completion("", [128]))
    splicer.accept(completion("\ufffd\ufffddead", [514, 515], finish="length"))
    assert (splicer.tokens, list(splicer.token_ids or ())) == (4, [31, 128, 514, 515])
    assert splicer.usage() == {"prompt_tokens": 3, "total_tokens": 7, "completion_tokens": 4}


def _cut_after_an_empty_text_token(*, asked: bool) -> Splicer:
    splicer = Splicer(chat=False, include_usage=True, hide_ids=not asked)
    splicer.accept(FIRST)  # ":" [31]
    splicer.accept(completion(" a", [40]))
    splicer.accept(completion("", [128]))  # the first byte of a character
    splicer.accept(completion("", [129]))  # its second
    return splicer


def test_a_continuation_by_ids_starts_after_the_last_token_that_brought_text() -> None:
    splicer = _cut_after_an_empty_text_token(asked=False)
    body = {"prompt": "x", "max_tokens": 10, "min_tokens": 6}
    assert by_ids(body, splicer, chat=False)
    splicer.next_segment()
    follow = continuation(body, splicer, chat=False, path=COMPLETIONS)
    assert (follow.method, follow.path) == ("token_ids", COMPLETIONS)
    assert follow.body == {"prompt": [564, 489, 503, 31, 40], "max_tokens": 8, "min_tokens": 4}  # not after 128, 129
    splicer.rewind()
    assert (splicer.tokens, splicer.shown, splicer.behind) == (2, 4, 0)


def test_the_regenerated_tokens_are_not_sent_twice_and_are_counted_once() -> None:
    splicer = _cut_after_an_empty_text_token(asked=True)
    splicer.next_segment()
    splicer.rewind()
    assert splicer.accept(completion("", [128], prompt=[1, 2])).out == b""  # the client had this chunk already
    out = relayed(splicer.accept(completion("é!", [129, 130])).out)
    assert (out["choices"][0]["text"], out["choices"][0]["token_ids"]) == ("é!", [130])
    out = relayed(splicer.accept(completion(" b", [131], finish="length")).out)
    assert out["choices"][0]["token_ids"] == [131]
    usage = {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4}
    splicer.accept(json.dumps({"id": "cmpl-b", "choices": [], "usage": usage}).encode())
    assert splicer.usage() == {"prompt_tokens": 3, "total_tokens": 9, "completion_tokens": 6}


def test_a_chat_continues_by_ids_on_completions_without_the_chat_only_fields() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.accept(CHAT_ROLE)
    splicer.accept(chat("spot", [557]))
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello node"}],
        "max_completion_tokens": 9,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [],
        "chat_template_kwargs": {"x": 1},
        "stop": ["\n"],
    }
    splicer.next_segment()
    follow = continuation(body, splicer, chat=True, path="/v1/chat/completions")
    assert (follow.path, follow.method, follow.chat) == (COMPLETIONS, "token_ids", False)
    assert follow.body == {
        "model": "tiny",
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["\n"],
        "prompt": [3, 287, 81, 81, 84, 535, 2, 4, 557],
        "max_tokens": 8,
        "logprobs": 2,
    }


def test_a_chat_without_a_limit_needs_the_context_length_to_continue_by_ids() -> None:
    splicer = Splicer(chat=True, include_usage=False)
    splicer.accept(CHAT_ROLE)
    splicer.accept(chat("spot", [557]))
    body = {"messages": [{"role": "user", "content": "hello node"}]}
    assert continuation(body, splicer, chat=True, path="/v1/chat/completions", context_len=2048).body["max_tokens"] == (
        2048 - 9
    )
    assert continuation(body, splicer, chat=True, path="/v1/chat/completions").method == "text"


def test_a_completions_chunk_becomes_the_chat_chunk_vllm_would_have_sent() -> None:
    chunk = json.loads(completion("g", [76], finish="length"))
    chunk["system_fingerprint"] = "vllm-0.32.0-7ec5102b"
    # vLLM 0.32.0's last chat chunk for the same token (measured), with token ids.
    assert as_chat(chunk, top_logprobs=0) == {
        "id": "cmpl-a",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "g"},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [76],
            }
        ],
        "system_fingerprint": "vllm-0.32.0-7ec5102b",
    }


def test_completions_logprobs_read_as_the_chats() -> None:
    # The same token's logprobs from vLLM 0.32.0, on /v1/completions and on /v1/chat/completions (measured).
    completions = {
        "text_offset": [4],
        "token_logprobs": [-0.24908028542995453],
        "tokens": ["g"],
        "top_logprobs": [{"g": -0.24908028542995453, "": -4.178168296813965}],
    }
    assert chat_logprobs(completions, top=2) == {
        "content": [
            {
                "token": "g",
                "logprob": -0.24908028542995453,
                "bytes": [103],
                "top_logprobs": [
                    {"token": "g", "logprob": -0.24908028542995453, "bytes": [103]},
                    {"token": "", "logprob": -4.178168296813965, "bytes": []},
                ],
            }
        ]
    }
    assert chat_logprobs(None, top=2) is None


def test_the_stall_bound_is_a_few_gaps_between_half_a_second_and_two() -> None:
    assert stall_bound(None) == STALL_MAX_S
    assert stall_bound(0.01) == STALL_MIN_S
    assert stall_bound(0.2) == pytest.approx(0.8)
    assert stall_bound(5.0) == STALL_MAX_S


def test_a_stream_counts_as_stalled_only_once_it_streams_and_past_its_bound() -> None:
    waiting, quick, slow = Mover(), Mover(), Mover()
    for mover, gap in ((quick, 0.02), (slow, 0.4)):
        mover.heard_at = 0.0
        for step in range(1, 20):
            mover.heard(step * gap)
    assert stalled([waiting, quick, slow], now=19 * 0.4 + 1.0) == [quick]
    assert stalled([waiting, quick, slow], now=19 * 0.4 + 2.1) == [quick, slow]
    assert stalled([waiting, quick, slow], now=19 * 0.4 + 0.6, bound_s=0.5) == [quick, slow]
    quick.move("stalled")
    assert stalled([quick], now=100.0) == []


def test_the_usual_gap_folded_at_each_stall_check_is_the_one_folded_at_each_read() -> None:
    each, ticked = Mover(), Mover()
    reads = [3.0 + 0.05 * step for step in range(60)]  # a slow first read (a prefill), then a read every 50 ms
    tick = 0.2  # STALL_CHECK_S: how often the stall watcher asks
    for mover in (each, ticked):
        mover.heard_at = 0.0
    for at in reads:
        each.heard(at)
        assert each.usual_gap() is not None
        if at >= tick:
            ticked.usual_gap()
            tick += 0.2
        ticked.heard(at)
    assert each.usual_gap() == pytest.approx(ticked.usual_gap(), rel=0.05)
    assert 0.05 < each.usual_gap() < 0.06  # type: ignore[operator]
    slow = Mover()
    slow.heard_at = 0.0
    slow.heard(5.0)
    assert slow.usual_gap() == 2.0  # GAP_SAMPLE_MAX_S: one long silence does not make the usual gap long


def test_a_backend_is_going_away_when_leaving_out_of_rotation_gone_or_failing() -> None:
    pool = Pool(["http://a:8000", "http://b:8000", "http://c:8000"], GatewayMetrics.create(CollectorRegistry()))
    a, b, c = pool.backends
    pool.set_ready(b, False)
    c.failing = True
    assert [pool.going_away(x.url) for x in (a, b, c)] == [False, True, True]
    assert pool.going_away("http://gone:8000")
    pool.set_leaving({a.url: datetime(2030, 1, 1, tzinfo=UTC)})
    assert pool.going_away(a.url)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
_SPACE = st.text(alphabet=" \t\r\n", max_size=3)


@given(
    st.dictionaries(st.sampled_from(["prompt", "model", FIELD, "stream"]) | st.text(max_size=6), _JSON, max_size=4),
    _SPACE,
    st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]),
    st.booleans(),
)
def test_a_request_asking_for_ids_is_the_clients_with_the_field_set(
    body: dict[str, Any], space: str, separators: tuple[str, str], ascii_only: bool
) -> None:
    raw = (space + json.dumps(body, separators=separators, ensure_ascii=ascii_only) + space).encode()
    sent = with_ids(body, raw)
    assert json.loads(sent) == {**body, FIELD: True}
    if FIELD not in body:
        assert sent.endswith(raw[raw.index(b"{") + 1 :])  # the client's bytes, as they came
