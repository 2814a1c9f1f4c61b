"""The gateway server's request heads: any bytes are a request or a BadRequest with its status, never a crash."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gateway.relay import forwarded, forwarded_lines
from gateway.request import BadRequest, header_lines, parse_head
from spotdrain.http1 import request_bytes


def test_a_head_gives_its_method_target_framing_and_whether_the_connection_ends() -> None:
    request, length, expects = parse_head(
        b"POST /v1/completions?x=1 HTTP/1.1\r\nHost: gw\r\nContent-Length: 12\r\nExpect: 100-continue\r\n"
        b"Connection: keep-alive, Close"
    )
    assert (request.method, request.target, request.path) == ("POST", "/v1/completions?x=1", "/v1/completions")
    assert (length, expects, request.closes, request.chunked) == (12, True, True, True)
    assert request.headers["host"] == "gw"
    chunked, length, _ = parse_head(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked")
    assert (length, chunked.closes, chunked.chunked) == (None, True, False)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /\tHTTP/1.1", 400),
        (b"GET * HTTP/1.1", 400),
        (b"GET / HTTP/1.1\r\nX : y", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: 1_0", 400),
        (b"POST / HTTP/1.1\r\nContent-Length: \xb2", 400),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip", 501),
        (b"POST / HTTP/1.1\r\nX-A: a\nContent-Length: 5", 400),
        (b"POST / HTTP/1.1\r\nX-A: a\x00b", 400),
        (b"GET /a\x7fb HTTP/1.1", 400),
    ],
)
def test_a_head_that_is_not_one_is_a_bad_request_with_its_status(head: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as raised:
        parse_head(head)
    assert raised.value.status == status


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_as_a_head_are_a_request_or_a_bad_request(data: bytes) -> None:
    try:
        request, length, _ = parse_head(data)
    except BadRequest as error:
        status = error.status
        assert status in (400, 501)
        return
    assert data.startswith(f"{request.method} {request.target} HTTP/1.".encode("latin-1"))
    assert length is None or length >= 0
    assert all(name.strip() == name for name in request.headers)  # its headers read again as they were read
    assert not any(c in value for value in request.headers.values() for c in "\r\n\x00")


_NAMES = st.sampled_from(
    ["Authorization", "X-Tag", "connection", "Keep-Alive", "TE", "Host", "content-length", "Content-Type", "Upgrade"]
) | st.from_regex(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,12}", fullmatch=True)
_VALUES = st.from_regex(
    r"[ \t]{0,2}[\x21-\x7e\x80-\xff]([\x20-\x7e\t\x80-\xff]{0,20}[\x21-\x7e\x80-\xff])?[ \t]{0,2}", fullmatch=True
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_NAMES, _VALUES), max_size=12), st.sampled_from([b"", b"application/json"]))
def test_a_heads_lines_passed_on_are_the_headers_passed_on(fields: list[tuple[str, str]], content_type: bytes) -> None:
    """The lines a stream sends on say what the parsed headers a whole request sends on say, in the same order."""
    head = "\r\n".join(f"{name}:{value}" for name, value in fields).encode("latin-1")
    try:
        request, _, _ = parse_head(b"POST / HTTP/1.1" + (b"\r\n" + head if head else b""))
    except BadRequest:
        assume(False)  # its framing refused (two lengths, a length that is not one): never passed on
    want = forwarded(request.headers)
    if content_type:
        want.popall("Content-Type", None)
        want["Content-Type"] = content_type.decode()
    lines = forwarded_lines(request.head, content_type=content_type)
    assert header_lines(lines.removesuffix(b"\r\n")) == want if lines else not want
    sent = [request_bytes("http://b:1", "/p", b"{}", headers) for headers in (lines, want)]
    (line, _, head), (their_line, _, their_head) = (raw.removesuffix(b"\r\n\r\n{}").partition(b"\r\n") for raw in sent)
    assert line == their_line == b"POST /p HTTP/1.1"
    assert header_lines(head) == header_lines(their_head)


def _by_mapping(head: bytes, version: str) -> tuple[bool, int | None, bool] | int:
    """What a request's header lines say of its framing, read from ``header_lines``' mapping of them: whether the
    connection closes, the body's length (None: chunked) and whether it expects ``100 Continue``; or the status a
    head it refuses gets."""
    try:
        headers = header_lines(head)
    except BadRequest as error:
        return error.status
    options = {token.strip().lower() for token in ",".join(headers.getall("Connection", [])).split(",")}
    lengths = set(headers.getall("Content-Length", []))
    coding = ",".join(headers.getall("Transfer-Encoding", [])).lower().replace(" ", "")
    if coding and lengths:
        return 400
    if coding and coding != "chunked":
        return 501
    length = next(iter(lengths), "0")
    if len(lengths) > 1 or not (length.isascii() and length.isdigit() and len(length) <= 18):
        return 400
    closes = "close" in options or version == "HTTP/1.0"
    return closes, None if coding else int(length), headers.get("Expect", "").lower() == "100-continue"


_FRAMING_NAMES = st.sampled_from(
    ["Connection", "connection", "CONTENT-LENGTH", "Content-Length", "Transfer-Encoding", "transfer-encoding", "Expect"]
)
_ANY_NAME = _FRAMING_NAMES | _NAMES | st.sampled_from(["", "X y", "X\n", "Con\rnection", "Expect ", "\x00"])
_ODD_VALUES = ["5", " 12 ", "1_0", "\xb2", "chunked", "Chunked, gzip", " close", "keep-alive, Close", "100-Continue"]
_ANY_VALUE = _VALUES | st.sampled_from([*_ODD_VALUES, "a\x7fb"]) | st.text(st.characters(max_codepoint=255), max_size=8)


@settings(max_examples=1000, deadline=None)
@given(
    st.lists(st.tuples(_ANY_NAME, st.sampled_from([":", ": ", "", " :"]), _ANY_VALUE), max_size=8),
    st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
)
def test_a_heads_framing_is_what_its_parsed_headers_say(fields: list[tuple[str, str, str]], version: str) -> None:
    """The framing read from a head in one pass over its lines is the one its headers' mapping gives, and a head one
    refuses, the other refuses with the same status."""
    head = "\r\n".join(name + colon + value for name, colon, value in fields).encode("latin-1")
    want = _by_mapping(head, version)
    data = f"POST / {version}".encode() + (b"\r\n" + head if head else b"")
    if isinstance(want, int):
        with pytest.raises(BadRequest) as raised:
            parse_head(data)
        assert raised.value.status == want
        return
    request, length, expects = parse_head(data)
    assert (request.closes, length, expects) == want
    assert request.head == head
