"""What a backend is sent of a client's head, on a stream and on its continuation: the client's own headers as they
came (Authorization, a repeated header in its order), none of its connection's (its ``Connection: close`` ends the
client's connection, not the gateway's to the backend, which is kept), and the gateway's own Host and length; a
continuation's body is the gateway's JSON, and its Content-Type says so, once."""

from __future__ import annotations

import asyncio
import json

from simulate.fakes.engine import EngineConfig
from tests.engines.cut_proxy import cut_proxy
from tests.gateway_harness import FAST_TOKENS_PER_S, engines, gateway, reference

PROMPT = "once upon a time"
CLIENT_HEAD = (
    b"Host: gateway.example\r\n"
    b"Authorization: Bearer k\r\n"
    b"X-Tag: one\r\n"
    b"Connection: close, Keep-Alive\r\n"
    b"Keep-Alive: timeout=5\r\n"
    b"TE: trailers\r\n"
    b"Proxy-Authorization: Basic eDp5\r\n"
    b"Accept-Encoding: gzip\r\n"
    b"X-Tag: two\r\n"
    b"Content-Type: application/json; charset=utf-8\r\n"
)
NOT_PASSED = {b"keep-alive", b"te", b"proxy-authorization", b"accept-encoding", b"transfer-encoding"}
HEALTHY = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S)


async def _streamed(port: int, body: bytes) -> str:
    """The text of a stream asked over HTTP/1.0 with ``CLIENT_HEAD`` (its end is the connection's)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.0\r\n" + CLIENT_HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    datas = [line[6:] for line in got.partition(b"\r\n\r\n")[2].split(b"\n") if line.startswith(b"data: ")]
    assert datas[-1] == b"[DONE]"
    return "".join(choice["text"] for d in datas[:-1] for choice in json.loads(d)["choices"])


def _values(head: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for key, value in head if key.lower() == name]


async def test_a_stream_and_its_continuation_carry_the_clients_headers_and_none_of_its_connections() -> None:
    asked = {"prompt": PROMPT, "max_tokens": 30, "stream": True}
    want = await reference("/v1/completions", asked)
    async with (
        engines(HEALTHY, HEALTHY) as (one, two),
        cut_proxy(f"http://127.0.0.1:{one}") as (first, first_port),
        cut_proxy(f"http://127.0.0.1:{two}") as (second, second_port),
    ):
        first.cuts[PROMPT] = second.cuts[PROMPT] = 5  # wherever it goes first, it breaks there and continues
        async with gateway(first_port, second_port) as gw:
            text = await _streamed(gw.port, json.dumps(asked).encode())
    assert text == want.text
    assert len(first.done + second.done) == 1
    cut_port = first_port if first.done else second_port
    started, continued = (first.heads + second.heads) if first.done else (second.heads + first.heads)
    for head in (started, continued):
        assert not {name.lower() for name, _ in head} & NOT_PASSED, head
        assert _values(head, b"authorization") == [b"Bearer k"]
        assert _values(head, b"x-tag") == [b"one", b"two"]
        assert _values(head, b"connection") == []
        assert len(_values(head, b"content-length")) == 1
    assert _values(started, b"host") == [b"127.0.0.1:%d" % cut_port]
    assert _values(continued, b"host") == [b"127.0.0.1:%d" % (first_port + second_port - cut_port)]
    assert _values(started, b"content-type") == [b"application/json; charset=utf-8"]
    assert _values(continued, b"content-type") == [b"application/json"]
