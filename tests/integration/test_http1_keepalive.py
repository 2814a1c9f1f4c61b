"""A connection kept for another request (``keep_alive``, ``Answer.release``): kept only where the answer lets it carry
one and its body ended clean, fit again once its chunked end has come, and a kept connection the server closed as
the request went (nothing of the answer read) told apart from one that broke inside its answer."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest

from simulate.fakes.processes import free_port
from spotdrain import http1
from spotdrain.http1_reads import Reads

STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENT = b"data: one\n\n"
WHOLE = [STREAM_HEAD, b"%x\r\n%b\r\n" % (len(EVENT), EVENT), b"0\r\n\r\n"]
Script = Sequence[bytes] | str  # an answer's pieces, or "close" or "reset": the connection ended instead


@dataclass
class Scripted:
    """What a raw server on 127.0.0.1 answers: the n-th request on any connection gets ``answers[n]``, its pieces
    written 20 ms apart (each its own read); the connection closes after the last."""

    answers: Sequence[Script]
    requests: list[bytes] = field(default_factory=list)
    connections: int = 0


@asynccontextmanager
async def scripted(*answers: Script) -> AsyncIterator[tuple[Scripted, str]]:
    script = Scripted(answers)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next((int(x[15:]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")), 0)
                script.requests.append(head + await reader.readexactly(length))
                answer = script.answers[len(script.requests) - 1]
                if answer == "reset":  # the close sends an RST
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                if isinstance(answer, str):
                    break
                for piece in answer:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.02)
                if len(script.requests) == len(script.answers):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    port = free_port()
    listening = await asyncio.start_server(handle, "127.0.0.1", port)
    try:
        yield script, f"http://127.0.0.1:{port}"
    finally:
        listening.close()
        await listening.wait_closed()


async def streamed(answer: http1.Answer) -> bytes:
    """The stream's events up to the first, where its caller stops (as the relay does at ``[DONE]``)."""
    pieces: list[bytes] = []

    def take(data: bytes) -> bool:
        pieces.append(data)
        return True

    await answer.deliver(take)
    return b"".join(pieces)


SETTLED_S = 0.15  # the server's pieces still on their way (20 ms apart) have come


async def test_a_kept_connection_carries_the_next_request_once_its_chunked_end_has_come() -> None:
    kept: list[Reads] = []
    async with scripted(WHOLE, WHOLE) as (script, url):
        first = await http1.connect(url, connect_s=1)
        await first.send("/v1/completions", b"{}", b"X-Tag: 1\r\n", keep_alive=True)
        assert first.persistent
        assert await streamed(first) == EVENT
        first.release(kept.append)  # its chunked end is still to come, in a read of its own
        (protocol,) = kept
        assert not protocol.idle
        await asyncio.sleep(SETTLED_S)
        assert protocol.idle
        second = http1.Answer(protocol, url)
        await second.send("/v1/completions", b"{}", b"", keep_alive=True)
        assert await streamed(second) == EVENT
        second.close()
    assert script.connections == 1
    assert [request.split(b"\r\n")[0] for request in script.requests] == [b"POST /v1/completions HTTP/1.1"] * 2
    assert all(b"connection:" not in request.lower() for request in script.requests)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ([STREAM_HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"), *WHOLE[1:]], "the server closes it"),
        ([STREAM_HEAD.replace(b"HTTP/1.1", b"HTTP/1.0"), *WHOLE[1:]], "an HTTP/1.0 answer"),
        ([b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n", EVENT, b""], "a body ended by the close"),
        ([*WHOLE[:2], b"5\r\nmore!\r\n", b"0\r\n\r\n"], "body bytes after the caller's end"),
        ([*WHOLE[:2], b"zz\r\n"], "a broken chunked framing"),
        ([*WHOLE, b"HTTP/1.1 200 OK\r\n"], "bytes after the body's end"),
    ],
)
async def test_a_connection_is_not_kept_where_the_answer_or_its_end_says_it_cannot_carry_another(
    answer: list[bytes], why: str
) -> None:
    kept: list[Reads] = []
    async with scripted(answer, WHOLE) as (_, url):
        got = await http1.connect(url, connect_s=1)
        await got.send("/", b"", b"", keep_alive=True)
        assert await streamed(got) == EVENT
        got.release(kept.append)
        await asyncio.sleep(SETTLED_S)
        assert not any(protocol.idle for protocol in kept), why
        got.close()


@pytest.mark.parametrize("ending", ["close", "reset"])
async def test_a_kept_connection_that_ends_before_a_byte_of_its_answer_is_unanswered(ending: str) -> None:
    kept: list[Reads] = []
    async with scripted(WHOLE, ending) as (_, url):
        first = await http1.connect(url, connect_s=1)
        await first.send("/", b"", b"", keep_alive=True)
        await streamed(first)
        first.release(kept.append)
        await asyncio.sleep(SETTLED_S)
        with pytest.raises(http1.Unanswered):
            await http1.Answer(kept[0], url).send("/", b"", b"", keep_alive=True)


async def test_a_connection_that_ends_inside_the_answers_head_is_a_reset_not_unanswered() -> None:
    async with scripted([b"HTTP/1.1 200 OK\r\nContent-Ty"]) as (_, url):
        got = await http1.connect(url, connect_s=1)
        with pytest.raises(ConnectionResetError) as raised:
            await got.send("/", b"", b"", keep_alive=True)
        got.close()
    assert not isinstance(raised.value, http1.Unanswered)
