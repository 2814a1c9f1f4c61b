"""The gateway server's request heads: any bytes are a request or a BadRequest with its status, never a crash."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.request import BadRequest, parse_head


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
