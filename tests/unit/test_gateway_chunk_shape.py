"""The splicer's fast path (a plain token chunk read by its stream's shape, gateway.chunk_shape) against its full
parse: the same bytes for the client and the same state for a continuation, whatever the chunks; pure, no servers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.sse_source import chunk as bench_chunk
from gateway import ends, splice
from gateway.backends import Mover
from gateway.chunk_shape import Shape, learn
from gateway.relay import ClientStream, _Events
from gateway.splice import Splicer
from tests.unit.test_gateway_splice import text_chunk

STATE = (
    *("text", "tokens", "token_ids", "prompt_token_ids", "resume_ids", "resume_text", "shown", "behind"),
    *("finish_reason", "tool_call", "reasoning", "multiple_choices", "identity", "role_sent"),
)


def vllm_chunk(text: str, ids: list[Any] | None, *, chat: bool = False, **choice: Any) -> bytes:
    """A token chunk in vLLM 0.32.0's field order and compact spelling (as bench/sse_source.py writes them)."""
    body: dict[str, Any] = {"index": 0}
    if chat:
        body["delta"] = {"content": text}
    else:
        body["text"] = text
    body |= {"logprobs": None, "finish_reason": None}
    if not chat:
        body["stop_reason"] = None
    body |= {"token_ids": ids, **choice}
    top = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 7}
    payload = json.dumps({**top, "model": "m", "choices": [body]}, separators=(",", ":"), ensure_ascii=False)
    return payload.encode("utf-8", "surrogatepass")


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def pair(*, chat: bool = False, hide_ids: bool = True) -> tuple[Splicer, Splicer]:
    """A splicer with its fast path, and one that parses every chunk."""
    return (
        Splicer(chat=chat, include_usage=False, hide_ids=hide_ids),
        Splicer(chat=chat, include_usage=False, hide_ids=hide_ids, shapes=False),
    )


def assert_same(fast: Splicer, full: Splicer, events: list[bytes]) -> None:
    for data in events:
        assert fast.accept(data) == full.accept(data), data
    for name in STATE:
        assert getattr(fast, name) == getattr(full, name), name


# Text as vLLM streams it, and as a backend need not: escapes, control characters, quotes, non-ASCII, surrogates.
texts = st.text(max_size=6) | st.sampled_from(["", " a", '"', "\\", "\n", "é", "\u2028", "\x7f", "\ud800", "日本"])
ids = st.none() | st.lists(st.integers(min_value=-1, max_value=2**64), max_size=3)
events = st.builds(
    vllm_chunk,
    texts,
    ids,
    chat=st.booleans(),
    **{"finish_reason": st.sampled_from([None, None, None, "length", "abort"])},
)
spelled = events | st.builds(lambda text, i: text_chunk(text, ids=i), texts, ids)  # json.dumps's own spacing
HEAD = b'{"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":[{"index":0,"text":'
odd = st.sampled_from(
    [
        HEAD + b'" a",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[01]}]}',  # a leading zero: not JSON
        HEAD + b'" a","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5]}]}  ',  # trailing spaces
        HEAD + b'" \xff","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5]}]}',  # not UTF-8
        HEAD + b'" \xed\xa0\x80",'
        b'"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5]}]}',  # an encoded surrogate
        HEAD + b'" a","logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":[5]}]',  # cut short
        b"[DONE]",
        b"",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(spelled | odd, max_size=12), st.booleans(), st.booleans())
def test_any_chunks_give_the_same_bytes_and_state_read_by_shape_as_parsed(
    chunks: list[bytes], chat: bool, hide_ids: bool
) -> None:
    first = vllm_chunk(" x", [1], chat=chat, prompt_token_ids=[7, 8])
    plain = [vllm_chunk(" y", [2], chat=chat), vllm_chunk(" z", [3], chat=chat)]  # so a shape is learned
    fast, full = pair(chat=chat, hide_ids=hide_ids)
    assert_same(fast, full, [first, *plain])
    assert fast.shape is not None
    assert_same(fast, full, chunks)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(texts, st.integers(min_value=0, max_value=10**18)), min_size=1, max_size=20),
    st.lists(st.integers(min_value=1, max_value=400), max_size=20),
    st.booleans(),
)
def test_split_reads_and_merged_events_reach_the_client_as_the_full_parse_relays_them(
    tokens: list[tuple[str, int]], cuts: list[int], hide_ids: bool
) -> None:
    """The relay's own path (gateway.relay._Events): a stream's bytes in reads cut anywhere, several events a read."""
    stream = b"".join(b"data: " + vllm_chunk(text, [token]) + b"\n\n" for text, token in tokens)
    stream += b"data: " + vllm_chunk("", [9], finish_reason="length") + b"\n\ndata: [DONE]\n\n"
    reads, at = [], 0
    for size in cuts:
        reads.append(stream[at : at + size])
        at += size
    reads.append(stream[at:])
    got = []
    for shapes in (True, False):
        client = Recorded()
        stream_ = ClientStream(client, write_timeout_s=1.0, on_gap=lambda _: None)  # type: ignore[arg-type]
        splicer = Splicer(chat=False, include_usage=False, hide_ids=hide_ids, shapes=shapes)
        events = _Events(splicer, stream_, Mover())
        for block in reads:
            if events.take(block) and events.end is not None:
                break
        sent = b"".join(client.sent) + stream_.held  # the finish read with its [DONE] goes with the stream's end
        got.append((sent, events.end, events.splicer.text, events.splicer.token_ids))
    assert got[0] == got[1]
    assert got[0][1] == ends.Finished()


class Recorded:
    """The client's connection, recording each write: gateway.server.Connection's ``send`` and ``finish`` (which
    writes the stream's end with its last piece), a client that reads as fast as it is written (False: its buffer
    is never full)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> bool:
        self.sent.append(data)
        return False

    def finish(self, last: bytes) -> bool:
        self.sent.append(last + END)
        return False


END = b"<the chunked end>"


def relayed() -> tuple[_Events, ClientStream, Recorded]:
    client = Recorded()
    stream = ClientStream(client, write_timeout_s=1.0, on_gap=lambda _: None)  # type: ignore[arg-type]
    return _Events(Splicer(chat=False, include_usage=False, hide_ids=True), stream, Mover()), stream, client


async def test_a_finish_read_with_its_done_goes_out_with_the_streams_end_in_one_write() -> None:
    events, stream, client = relayed()
    assert events.take(event(vllm_chunk(" a", [5]))) is False
    assert events.take(event(vllm_chunk(" b", [6], finish_reason="length")) + ends.DONE) is True
    assert events.end == ends.Finished()
    assert client.sent == [event(vllm_chunk(" a", None))]  # the finish is held: the stream's end comes next
    await stream.end(events.splicer.tail())
    assert client.sent[1:] == [event(vllm_chunk(" b", None, finish_reason="length")) + ends.DONE + END]
    assert stream.held == b""


async def test_a_finish_read_alone_goes_out_at_once() -> None:
    events, stream, client = relayed()
    last = event(vllm_chunk(" b", [6], finish_reason="length"))
    assert events.take(last) is False
    assert client.sent == [event(vllm_chunk(" b", None, finish_reason="length"))]
    assert events.take(ends.DONE) is True
    await stream.end(events.splicer.tail())
    assert client.sent[1:] == [ends.DONE + END]


def test_a_vllm_stream_is_parsed_for_its_first_chunks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    parsed: list[bytes] = []
    parse = splice.parse_json

    def counted(data: bytes) -> Any:
        parsed.append(data)
        return parse(data)

    monkeypatch.setattr(splice, "parse_json", counted)
    splicer = Splicer(chat=False, include_usage=False, hide_ids=True)
    for index in range(100):
        out = splicer.accept(bench_chunk(index, last=index == 99, ids=True)[6:-2]).out
        assert out == bench_chunk(index, last=index == 99, ids=False, written_ns=_written(out))
    assert len(parsed) == 3  # the one with the prompt's ids, the one its shape is learned from, the finish
    assert splicer.tokens == 100
    assert splicer.token_ids is not None
    assert list(splicer.token_ids) == [100 + i for i in range(100)]
    assert splicer.resume_ids == 100


def _written(out: bytes) -> int:
    return int(json.loads(out[6:])["choices"][0]["text"])


def test_a_chat_stream_is_read_by_shape_after_its_role() -> None:
    splicer = Splicer(chat=True, include_usage=False, hide_ids=True)
    role = vllm_chunk("", None, chat=True).replace(b'{"content":""}', b'{"role":"assistant","content":""}')
    splicer.accept(role)
    splicer.accept(vllm_chunk(" a", [5], chat=True))
    assert splicer.shape is not None
    assert splicer.by_shape(event(vllm_chunk(" b", [6], chat=True))) == event(vllm_chunk(" b", None, chat=True))
    assert splicer.text_so_far == " a b"


def test_a_continuation_is_parsed_and_its_first_backends_shape_is_forgotten() -> None:
    splicer = Splicer(chat=False, include_usage=False)
    splicer.accept(vllm_chunk(" a", [5]))
    assert splicer.shape is not None
    splicer.next_segment()
    assert splicer.shape is None
    assert splicer.by_shape(event(vllm_chunk(" b", [6]))) is None


def test_a_stream_without_ids_is_read_by_shape_counting_a_token_a_chunk_with_text() -> None:
    fast, full = pair()
    chunks = [vllm_chunk(" a", None), vllm_chunk(" b", None), vllm_chunk("", None), vllm_chunk(" c", None)]
    assert_same(fast, full, chunks)
    assert fast.shape is not None
    assert fast.shape.ids is False
    assert (fast.tokens, fast.token_ids) == (3, None)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (vllm_chunk(" a", [5]).replace(b'" a"', b'" \\u0061"'), "an escape anywhere"),
        (vllm_chunk(" a", [5], finish_reason="length"), "a finish"),
        (vllm_chunk(" a", [5], prompt_token_ids=[1, 2]), "prompt ids"),
        (vllm_chunk(" a", [5, 6]), "several ids"),
        (vllm_chunk(" a", [5]).replace(b'"token_ids":[5]', b'"token_ids":[5],"x":{"token_ids":[5]}'), "a key twice"),
        (text_chunk(" a", ids=[5]), "spaces json.dumps puts in, which hide() takes out"),
    ],
)
def test_what_no_shape_is_learned_from(data: bytes, why: str) -> None:
    choice = json.loads(data)["choices"][0]
    assert learn(data, choice, chat=False) is None, why


@pytest.mark.parametrize(
    ("delta", "why"),
    [({"role": "assistant", "content": "a"}, "a role"), ({"content": "a", "tool_calls": [{}]}, "a tool call")],
)
def test_what_no_chat_shape_is_learned_from(delta: dict[str, Any], why: str) -> None:
    data = vllm_chunk("a", [5], chat=True).replace(b'{"content":"a"}', json.dumps(delta).encode())
    assert learn(data, json.loads(data)["choices"][0], chat=True) is None, why


SHAPE = Shape(b'data: {"choices":[{"text":"', b'","token_ids":[', b"}]}\n\n", ids=True)


@pytest.mark.parametrize(
    ("data", "slots"),
    [
        (b'{"choices":[{"text":" a","token_ids":[5]}]}', (b" a", 5, 37)),
        (b'{"choices":[{"text":"","token_ids":[0]}]}', (b"", 0, 35)),
        ('{"choices":[{"text":"é\x7f","token_ids":[5]}]}'.encode(), ("é\x7f".encode(), 5, 38)),
        (b'{"choices":[{"text":"a\\"b","token_ids":[5]}]}', None),  # an escape
        (b'{"choices":[{"text":"a\nb","token_ids":[5]}]}', None),  # a control character
        (b'{"choices":[{"text":"\xe6\x97","token_ids":[5]}]}', None),  # half a character
        (b'{"choices":[{"text":" a","token_ids":[05]}]}', None),
        (b'{"choices":[{"text":" a","token_ids":[123456789012345678]}]}', (b" a", 123456789012345678, 37)),
        (b'{"choices":[{"text":" a","token_ids":[1234567890123456789]}]}', None),  # past 18 digits
        (b'{"choices":[{"text":" a","token_ids":[-5]}]}', None),
        (b'{"choices":[{"text":" a","token_ids":[5 ]}]}', None),
        (b'{"choices":[{"text":" a","token_ids":[5,6]}]}', None),
        (b'{"choices":[{"text":" a","token_ids":[]}]}', None),
        (b'{"choices":[{"text":" a","token_ids":[5]}]', None),  # the tail cut
        (b'{"choices":[{"text":" a","token_ids":[5]}]}}', None),
        (b'{"choices":[{"text":" a","token_ids":[5]},{"text":"b","token_ids":[6]}]}', None),  # a second choice
        (b'{"choices":[{"text":" a","logprobs":null,"token_ids":[5]}]}', None),  # another middle
        (b'{"choices":[{"index":1,"text":" a","token_ids":[5]}]}', None),  # another prefix
        (b'{"choices":[{"text":" a', None),
    ],
)
def test_what_a_shape_reads_and_what_it_leaves_to_the_parse(data: bytes, slots: tuple[bytes, int, int] | None) -> None:
    assert SHAPE.match(event(data)) == (slots and (slots[0], slots[1], slots[2] + len(b"data: ")))


@pytest.mark.parametrize(
    "read",
    [
        event(b'{"choices":[{"text":" a","token_ids":[5]}]}') + event(b'{"choices":[{"text":" b","token_ids":[6]}]}'),
        b'data: {"choices":[{"text":" a","token_ids":[5]}]}\n',
        b'data: {"choices":[{"text":" a","token_ids":[5]}]}\r\n\r\n',
        b'data:{"choices":[{"text":" a","token_ids":[5]}]}\n\n',
    ],
)
def test_a_read_that_is_not_one_event_of_the_shape_goes_to_the_event_parser(read: bytes) -> None:
    assert SHAPE.match(read) is None
