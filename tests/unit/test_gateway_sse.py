"""The backend event parser: any bytes in any blocks, never a crash, the same events however the bytes are split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sse import EventTooLarge, SseParser


def parse(blocks: list[bytes], *, limit: int = 1 << 20) -> list[bytes]:
    parser = SseParser(max_event_bytes=limit)
    return [event for block in blocks for event in parser.feed(block)] + parser.close()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(data)) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@given(st.binary(max_size=2000), st.lists(st.integers(min_value=0, max_value=2000), max_size=20))
def test_arbitrary_bytes_never_crash_and_splitting_does_not_change_the_events(data: bytes, cuts: list[int]) -> None:
    assert parse(split(data, cuts)) == parse([data])


@given(
    st.lists(st.binary(max_size=50).filter(lambda b: b"\n" not in b and b"\r" not in b), max_size=10),
    st.sampled_from([b"\n", b"\r\n", b"\r"]),
    st.lists(st.integers(min_value=0, max_value=2000), max_size=10),
)
def test_every_data_line_comes_back_whatever_the_line_ending(
    payloads: list[bytes], newline: bytes, cuts: list[int]
) -> None:
    stream = b"".join(b"data: " + p + newline + b": keep-alive" + newline + newline for p in payloads)
    assert parse(split(stream, cuts)) == payloads


def test_multi_line_data_joins_with_newlines_and_comments_are_skipped() -> None:
    assert parse([b": hello\n\ndata: a\ndata:b\nevent: x\n\ndata\n\n"]) == [b"a\nb", b""]


def test_lines_that_are_no_field_are_counted_as_junk() -> None:
    parser = SseParser()
    assert parser.feed(b"<html>\nnot sse\n\n") == []
    assert parser.junk == 2


@given(st.binary(min_size=65, max_size=300).filter(lambda b: b"\n" not in b and b"\r" not in b))
def test_an_endless_line_is_refused_past_the_limit(line: bytes) -> None:
    with pytest.raises(EventTooLarge):
        parse([b"data: " + line], limit=64)


PIECES = st.sampled_from([b"a", b"{}", b" ", b"\n", b"\r", b"\r\n", b"data: ", b"data:", b": x", b"event: e", b"\xff"])


@given(st.lists(st.lists(PIECES, max_size=6).map(b"".join), min_size=1, max_size=6), st.booleans())
def test_a_block_of_whole_events_gives_what_the_same_bytes_give_a_byte_at_a_time(
    payloads: list[bytes], crlf: bool
) -> None:
    """An engine's reads are whole events, each one data line: the parser takes those at once, and must give what
    the line-by-line reading gives for the same bytes, whatever the payloads hold."""
    newline = b"\r\n" if crlf else b"\n"
    stream = b"".join(b"data: " + p + newline + newline for p in payloads)
    assert parse([stream]) == parse([stream[at : at + 1] for at in range(len(stream))])
