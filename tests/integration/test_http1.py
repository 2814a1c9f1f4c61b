"""The gateway's own reader of a backend's answer: every framing, however the bytes are split into reads, gives the
body exactly; a cut, a refusal and bytes that are not HTTP each end it the way the relay names."""

from __future__ import annotations

import asyncio
import base64
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simulate.fakes.processes import free_port
from spotdrain import http1, http1_delivery
from spotdrain.http1_reads import BUFFER, Reads

Reader = Callable[[http1.Answer], Awaitable[bytes]]
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Request-Id: abc\r\nX-Twice: 1\r\nX-Twice: 2\r\n"


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = [], 0
    for size in [*sizes, len(body)]:
        piece = body[at : at + max(1, size)]
        if piece:
            out.append(b"%x;ext=1\r\n%b\r\n" % (len(piece), piece))
        at += len(piece)
    return b"".join(out) + b"0\r\n\r\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if data[a:b]]


def answer_of(blocks: list[bytes], *, closed: bool = True) -> http1.Answer:
    """An answer whose connection has already brought ``blocks`` (and ended, when ``closed``)."""
    protocol = Reads()
    protocol.blocks.extend(blocks)
    protocol.eof = closed
    return http1.Answer(protocol, "http://127.0.0.1:1")


async def body_of(answer: http1.Answer) -> bytes:
    await answer._read_head()
    return await answer.read()


async def delivered(answer: http1.Answer, *, stop_every: int = 1) -> bytes:
    """The body through ``deliver``, its taker asking to stop after every ``stop_every``-th piece (as the relay does
    when the client's buffer is full), then going on."""
    await answer._read_head()
    pieces: list[bytes] = []

    def take(data: bytes) -> bool:
        pieces.append(data)
        return len(pieces) % stop_every == 0

    while await answer.deliver(take):
        pass
    return b"".join(pieces)


async def delivered_in_one(answer: http1.Answer) -> bytes:
    return await delivered(answer, stop_every=1_000_000)


READERS = pytest.mark.parametrize("read_body", [body_of, delivered, delivered_in_one])


@READERS
@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=300), sizes=st.lists(st.integers(1, 40)), cuts=st.lists(st.integers(0, 10_000)))
async def test_a_chunked_body_comes_out_whole_however_its_bytes_are_split(
    body: bytes, sizes: list[int], cuts: list[int], read_body: Reader
) -> None:
    wire = HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(body, sizes)
    answer = answer_of(split(wire, cuts))
    assert await read_body(answer) == body
    assert answer.status == 200
    assert answer.headers.getall("X-Twice") == ["1", "2"]
    assert answer.headers["x-request-id"] == "abc"


@READERS
@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
    broken=st.integers(0, 7),
    crlf=st.binary(min_size=2, max_size=2).filter(lambda pair: pair != b"\r\n"),
    size_format=st.sampled_from([b"%x", b"%X;ext=1"]),
    cuts=st.lists(st.integers(0, 10_000)),
)
async def test_a_chunk_whose_data_is_not_followed_by_crlf_is_a_bad_answer_however_its_bytes_are_split(
    pieces: list[bytes], broken: int, crlf: bytes, size_format: bytes, cuts: list[int], read_body: Reader
) -> None:
    at = broken % len(pieces)  # the chunk whose CRLF is replaced
    wire = b"".join(
        size_format % len(piece) + b"\r\n" + piece + (crlf if index == at else b"\r\n")
        for index, piece in enumerate(pieces)
    )
    with pytest.raises(http1.BadAnswer):
        await read_body(answer_of(split(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + wire + b"0\r\n\r\n", cuts)))


@READERS
@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=200), extra=st.binary(max_size=20), cuts=st.lists(st.integers(0, 10_000)))
async def test_a_sized_body_ends_at_its_length_and_a_closed_one_at_the_close(
    body: bytes, extra: bytes, cuts: list[int], read_body: Reader
) -> None:
    sized = HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body + extra
    assert await read_body(answer_of(split(sized, cuts))) == body
    assert await read_body(answer_of(split(HEAD + b"\r\n" + body, cuts))) == body


async def test_interim_answers_are_passed_over_for_the_final_one() -> None:
    wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    wire += HEAD + b"Content-Length: 5\r\n\r\nhello"
    answer = answer_of(split(wire, [3, 30, 60]))
    assert await body_of(answer) == b"hello"
    assert (answer.status, "Link" in answer.headers) == (200, False)


async def delivered_read_by_read(head: bytes, reads: list[bytes], *, stop_every: int) -> bytes:
    """The body through ``deliver``, each of ``reads`` one read of the socket as asyncio's transport hands it on
    (``data_received``: docs.python.org/3/library/asyncio-protocol.html#streaming-protocols), then the close; the
    taker asks to stop after every ``stop_every``-th piece, and a read that comes before the stop takes is kept, as
    the transport pauses only then."""
    protocol = Reads()
    protocol.blocks.append(head)
    answer = http1.Answer(protocol, "http://127.0.0.1:1")
    await answer._read_head()
    pieces: list[bytes] = []

    def take(data: bytes) -> bool:
        pieces.append(data)
        return len(pieces) % stop_every == 0

    left = iter(reads)
    while True:
        delivery = asyncio.ensure_future(answer.deliver(take))
        await asyncio.sleep(0)
        while not delivery.done():
            if (read := next(left, None)) is None:
                protocol.connection_lost(None)
            else:
                protocol.data_received(read)
            await asyncio.sleep(0)
        if not delivery.result():
            return b"".join(pieces)


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(st.binary(min_size=1, max_size=300), max_size=12),
    size_format=st.sampled_from([b"%x", b"%X", b"0%x", b"%x;ext=1"]),
    whole=st.lists(st.integers(0, 100)),
    cuts=st.lists(st.integers(0, 10_000), max_size=3),
    stop_every=st.sampled_from([1, 2, 1_000_000]),
)
async def test_a_chunked_body_read_by_read_comes_out_whole_with_reads_of_whole_chunks_or_not(
    events: list[bytes], size_format: bytes, whole: list[int], cuts: list[int], stop_every: int
) -> None:
    chunks = [size_format % len(event) + b"\r\n" + event + b"\r\n" for event in events] + [b"0\r\n\r\n"]
    wire = b"".join(chunks)
    starts = list(itertools.accumulate(len(chunk) for chunk in chunks))
    reads = split(wire, [starts[at % len(starts)] for at in whole] + cuts)  # mostly whole chunks, some cut
    head = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    assert await delivered_read_by_read(head, reads, stop_every=stop_every) == b"".join(events)


def test_the_size_line_of_a_read_that_is_one_chunk_is_that_chunks_and_only_short_reads_keep_theirs() -> None:
    for end in [*range(70_000), 1 << 20, (1 << 20) + 5]:
        lines = [b"%x\r\n" % size for d in range(1, 17) if (size := end - 4 - d) > 0 and len(b"%x" % size) == d]
        assert len(lines) <= 1, end
        assert http1_delivery._head(end) == (lines[0] if lines else b""), end
        assert (end in http1_delivery._HEADS) == (end <= http1_delivery._HEADS_UP_TO)


@pytest.mark.parametrize(
    ("reads", "raised"),
    [
        ([b"5\r\nhello\r\n", b"5\r\nhel"], ConnectionResetError),  # a whole chunk, then one the close cuts
        ([b"5\r\nhello\r\n", b"5"], ConnectionResetError),  # a size line the close cuts
        ([b"5\r\nhello\r\n", b"5\r\nhello\r\n"], ConnectionResetError),  # whole chunks, and no last one
        ([b"5\r\nhello\r\n", b"0x5\r\nhello\r\n"], http1.BadAnswer),  # a size int() would take
        ([b"5\r\nhello\r\n", b"5_0\r\n" + b"x" * 80 + b"\r\n"], http1.BadAnswer),
        ([b"5\r\nhello\r\n", b"zz\r\nhello\r\n"], http1.BadAnswer),
        ([b"5\r\nhello\r\n5\r\nhello\r\n" + b"z" * 100 + b"\r\n"], http1.BadAnswer),  # a long size line
        ([b"5\r\nhelloXY"], http1.BadAnswer),  # a whole chunk's length, without its CRLF
        ([b"5\r\nhelloXY3\r\nabc\r\n0\r\n\r\n"], http1.BadAnswer),  # so, in a read of more than one chunk
        ([b"5\r\nhello\r", b"X3\r\nabc\r\n0\r\n\r\n"], http1.BadAnswer),  # a CR, then not an LF
        ([b"5\r\nhello", b"\n\r3\r\nabc\r\n0\r\n\r\n"], http1.BadAnswer),  # LF CR
        ([b"6\r\nhello\r\n0\r\n\r\n"], http1.BadAnswer),  # a size one over
    ],
)
async def test_a_chunked_body_read_by_read_that_is_cut_or_broken_is_a_reset_or_a_bad_answer(
    reads: list[bytes], raised: type[Exception]
) -> None:
    head = HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
    with pytest.raises(raised):
        await delivered_read_by_read(head, reads, stop_every=1)


@pytest.mark.parametrize(
    "wire",
    [
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhel",  # inside a chunk
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",  # before the last chunk
        HEAD + b"Content-Length: 10\r\n\r\nhello",
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n",  # inside the head
    ],
)
@READERS
async def test_a_connection_that_ends_before_the_body_does_is_a_reset(wire: bytes, read_body: Reader) -> None:
    with pytest.raises(ConnectionResetError):
        await read_body(answer_of([wire]))


@pytest.mark.parametrize(
    "wire",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/1.1 OK\r\n\r\n",
        HEAD + b"no colon here\r\n\r\n",
        HEAD + b"Content-Length: ten\r\n\r\n",
        HEAD + b"Content-Length: \xb2\r\n\r\n",
        b"HTTP/1.1 \xb2\xb2\xb2 OK\r\n\r\n",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n-5\r\nhello\r\n",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n\r\n",
        HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXY0\r\n\r\n",
    ],
)
@READERS
async def test_bytes_that_are_not_an_http_answer_are_a_bad_answer(wire: bytes, read_body: Reader) -> None:
    with pytest.raises(http1.BadAnswer):
        await read_body(answer_of([wire]))


@asynccontextmanager
async def server(answer: Callable[[bytes], list[bytes]], *, port: int | None = None) -> AsyncIterator[int]:
    """A raw server on 127.0.0.1 (on ``port`` where given): reads a request's head and body, writes
    ``answer(request)`` (an empty piece: a pause of 5 s), closes."""
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        lengths = (int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
        length = next(lengths, 0)
        request = head + await reader.readexactly(length)
        got.append(request)
        for piece in answer(request):
            if not piece:
                await asyncio.sleep(5)
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    port = port or free_port()
    listening = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield port
    finally:
        listening.close()
        await listening.wait_closed()


async def test_the_request_carries_the_body_and_headers_given_and_asks_to_close_and_the_body_streams_in() -> None:
    requests: list[bytes] = []

    def answer(request: bytes) -> list[bytes]:
        requests.append(request)
        return [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"6\r\ndata: \r\n", b"3\r\none\r\n", b"0\r\n\r\n"]

    async with server(answer) as port:
        url = f"http://127.0.0.1:{port}"
        got = await http1.connect(url, connect_s=1)
        headers = {"Authorization": "Bearer t", "Content-Type": "application/json", "Connection": "keep-alive"}
        await got.send("/v1/completions", b'{"stream":true}', headers)
        blocks = [block async for block in got.body()]
        got.close()
    assert b"".join(blocks) == b"data: one"
    head, _, body = requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    assert set(lines[1:]) == {
        f"Host: 127.0.0.1:{port}".encode(),
        b"Content-Length: 15",
        b"Connection: close",
        b"Authorization: Bearer t",
        b"Content-Type: application/json",
    }
    assert body == b'{"stream":true}'


async def test_a_refused_connection_is_an_os_error() -> None:
    with pytest.raises(OSError):  # noqa: PT011 - the relay calls any OSError at connect "unavailable"
        await http1.connect(f"http://127.0.0.1:{free_port()}", connect_s=1)


async def test_a_backend_that_closes_inside_its_body_ends_the_answer_with_a_reset() -> None:
    async with server(lambda _: [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", b"5\r\nhel"]) as port:
        got = await http1.connect(f"http://127.0.0.1:{port}", connect_s=1)
        await got.send("/", b"", {})
        with pytest.raises(ConnectionResetError):
            await got.read()
        got.close()


async def test_a_delivery_its_taker_stops_takes_nothing_more_until_called_again() -> None:
    events = [b"data: %d\n\n" % index for index in range(8)]
    wire = [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", *(b"%x\r\n%b\r\n" % (len(e), e) for e in events)]
    pieces: list[bytes] = []

    def take(data: bytes) -> bool:
        pieces.append(data)
        return True

    async with server(lambda _: [*wire, b"0\r\n\r\n"]) as port:
        got = await http1.connect(f"http://127.0.0.1:{port}", connect_s=1)
        await got.send("/", b"", {})
        stops = 0
        while await got.deliver(take):
            stops += 1
            await asyncio.sleep(0.03)  # the server writes on meanwhile, and the kernel holds it
            assert got._protocol.blocks == []
        got.close()
    assert b"".join(pieces) == b"".join(events)
    assert stops == len(pieces)


async def test_what_the_taker_raises_comes_out_of_the_delivery() -> None:
    def take(data: bytes) -> bool:
        raise ConnectionResetError("the client went")

    async with server(lambda _: [HEAD + b"Content-Length: 5\r\n\r\n", b"hello"]) as port:
        got = await http1.connect(f"http://127.0.0.1:{port}", connect_s=1)
        await got.send("/", b"", {})
        with pytest.raises(ConnectionResetError, match="the client went"):
            await got.deliver(take)
        got.close()


SIZED = HEAD + b"Content-Length: 10\r\n\r\n"


@pytest.mark.parametrize(
    ("pieces", "raised"),
    [
        ([SIZED + b"0123", b"456", b"789"], None),
        ([SIZED + b"0123", b"456"], ConnectionResetError),  # the connection closed short of the length
        ([SIZED + b"0123", b""], TimeoutError),  # the server holds, sending nothing
        ([SIZED + b"0123", b"456789 and bytes past the length"], None),
    ],
)
@pytest.mark.parametrize("buffered", [True, False])
async def test_a_sized_body_is_written_straight_from_each_read_and_ends_where_its_length_does(
    pieces: list[bytes], raised: type[Exception] | None, buffered: bool
) -> None:
    written: list[bytes] = []
    shared: list[bool] = []

    def write(view: memoryview) -> None:
        written.append(bytes(view))
        shared.append(view.obj is BUFFER)

    async with server(lambda _: pieces) as port:
        got = await http1.connect(f"http://127.0.0.1:{port}", connect_s=1, buffered=buffered)
        await got.send("/model.safetensors?X-Amz-Signature=abc", b"", {"Range": "bytes=0-9"}, method="GET")
        assert got.length == 10
        if raised is None:
            await got.write_body(write, idle_s=1)
        else:
            with pytest.raises(raised):
                await got.write_body(write, idle_s=0.3)
        got.close()
    assert any(shared) is (buffered and len(shared) > 1)  # reads into the shared buffer written from it, uncopied
    assert b"".join(written) == b"0123456789"[: sum(map(len, written))]
    if raised is None:
        assert b"".join(written) == b"0123456789"


async def test_what_the_writer_raises_comes_out_of_the_read_and_a_get_carries_no_body() -> None:
    requests: list[bytes] = []

    def answer(request: bytes) -> list[bytes]:
        requests.append(request)
        return [SIZED + b"0123", b"456789"]

    def full(view: memoryview) -> None:
        raise OSError(28, "No space left on device")

    async with server(answer) as port:
        got = await http1.connect(f"http://127.0.0.1:{port}", connect_s=1)
        await got.send("/f?a=1", b"", {}, method="GET")
        with pytest.raises(OSError, match="No space left"):
            await got.write_body(full, idle_s=1)
        got.close()
    lines = requests[0].split(b"\r\n")
    assert lines[0] == b"GET /f?a=1 HTTP/1.1"
    assert not any(line.lower().startswith(b"content-length") for line in lines)


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        (b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n", ConnectionRefusedError),
        (b"", TimeoutError),  # the proxy holds the tunnel's request
        (b"<html>a captive portal</html>\r\n\r\n", http1.BadAnswer),
    ],
)
async def test_a_proxy_that_refuses_holds_or_answers_garbage_to_connect_gives_no_connection(
    answer: bytes, raised: type[Exception]
) -> None:
    requests: list[bytes] = []

    def proxy(request: bytes) -> list[bytes]:
        requests.append(request)
        return [answer]

    async with server(proxy) as port:
        with pytest.raises(raised):
            await http1.connect("https://models.example:8443", connect_s=0.5, proxy=f"http://u:p%40ss@127.0.0.1:{port}")
    lines = requests[0].split(b"\r\n")
    assert lines[0] == b"CONNECT models.example:8443 HTTP/1.1"
    assert b"Proxy-Authorization: Basic " + base64.b64encode(b"u:p@ss") in lines


@pytest.mark.parametrize(
    "headers", [{"X-Tag": "one", "Authorization": "Bearer k"}, b"X-Tag: one\r\nAuthorization: Bearer k\r\n"]
)
async def test_a_request_through_a_proxy_in_absolute_form_carries_its_headers_and_the_proxys(
    headers: dict[str, str] | bytes,
) -> None:
    requests: list[bytes] = []

    def proxy(request: bytes) -> list[bytes]:
        requests.append(request)
        return [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]

    async with server(proxy) as port:
        answer = await http1.connect("http://models.example:8080", connect_s=2.0, proxy=f"http://u:p@127.0.0.1:{port}")
        await answer.send("/v1/x", b"{}", headers)
        assert b"".join([piece async for piece in answer.body()]) == b"ok"
        answer.close()
    head, _, body = requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST http://models.example:8080/v1/x HTTP/1.1"
    assert sorted(lines[1:]) == sorted(
        [
            b"Host: models.example:8080",
            b"Content-Length: 2",
            b"Connection: close",
            b"X-Tag: one",
            b"Authorization: Bearer k",
            b"Proxy-Authorization: Basic " + base64.b64encode(b"u:p"),
        ]
    )
    assert body == b"{}"
