"""The I/O of one backend answer: send the request, relay the events through the splicer, say how it ended.

Every await is bounded: connecting by ``connect_s``, each read from the backend and each write to the client by
``read_s`` (a hung backend and a client that stopped reading look the same from here: silence).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from multidict import CIMultiDict

from gateway.backends import Backend, Mover
from gateway.ends import Broken, End, Finished
from gateway.server import Connection
from gateway.settings import TimeoutSettings
from gateway.splice import Splicer
from gateway.sse import EventTooLarge, SseParser
from spotdrain import http1

# RFC 9110 section 7.6.1 connection-specific fields, plus what the proxy sets itself (length, encoding, host).
_NOT_FORWARDED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "content-encoding",
        "date",
        "server",
    }
)


def forwarded(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Headers to pass on (Authorization included): all but the connection-specific ones."""
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _NOT_FORWARDED)


def _dropping(names: frozenset[str]) -> re.Pattern[bytes]:
    """What a header line named one of ``names`` is, after the CRLF before it."""
    alternatives = b"|".join(re.escape(name.encode()) for name in sorted(names))
    return re.compile(rb"\r\n(?:" + alternatives + rb"):[^\r]*", re.IGNORECASE)


_DROPPED = _dropping(_NOT_FORWARDED)
_DROPPED_AND_TYPE = _dropping(_NOT_FORWARDED | {"content-type"})


def forwarded_lines(head: bytes, *, content_type: bytes = b"") -> bytes:
    """The same from a request's header lines as the server read them (``Request.head``, each line already checked
    there: a line break is the CRLF between lines), as lines to send on, in one pass over them: no mapping is built
    for a request that is only passed on. ``content_type``: the client's replaced by this one."""
    kept = (_DROPPED_AND_TYPE if content_type else _DROPPED).sub(b"", b"\r\n" + head) if head else b""
    lines = kept[2:] + b"\r\n" if kept else b""
    return lines + b"Content-Type: " + content_type + b"\r\n" if content_type else lines


class ClientGone(Exception):
    """The client closed its connection or stopped reading: nothing more can reach it."""


@dataclass(frozen=True)
class Rejected:
    """The backend refused the request before streaming (a 4xx): before the client's stream started, the client gets
    that answer as it is."""

    status: int
    headers: CIMultiDict[str]
    body: bytes


class ClientStream:
    """The answer to the client: its head goes out with the first backend that streams; writes are bounded."""

    __slots__ = ("connection", "gap_from", "held", "last_write", "on_gap", "started", "write_timeout_s")

    def __init__(self, connection: Connection, *, write_timeout_s: float, on_gap: Callable[[float], None]) -> None:
        self.connection = connection
        self.write_timeout_s = write_timeout_s
        self.on_gap = on_gap  # seconds between the last chunk before a break and the first after it
        self.started = False
        self.last_write = time.monotonic()
        self.gap_from: float | None = None  # set at a break, until the continuation's first chunk
        self.held = b""  # the answer's last content, for the stream's last write

    def start(self, headers: Mapping[str, str]) -> None:
        if not self.started:
            try:
                self.connection.begin(forwarded(headers))
            except ConnectionError as error:
                raise ClientGone(str(error)) from None
            self.started = True

    async def write(self, data: bytes, *, content: bool = True) -> None:
        if self.send(data, content=content):
            await self.drain()

    def send(self, data: bytes, *, content: bool = True, now: float | None = None) -> bool:
        """Write ``data`` now (``now``: the monotonic time, where the caller has it); True where the client's buffer
        is full and ``drain`` is to be awaited."""
        try:
            full = self.connection.send(data)
        except ConnectionError as error:
            raise ClientGone(str(error)) from None
        if content:
            self._wrote(time.monotonic() if now is None else now)
        return full

    def hold(self, data: bytes, now: float) -> None:
        """``data``, the answer's last content (its finish, read with its ``[DONE]``), to go with the stream's end:
        one write, and one wakeup of the client, not two."""
        self.held += data
        self._wrote(now)

    def _wrote(self, now: float) -> None:
        if self.gap_from is not None:
            self.on_gap(now - self.gap_from)
            self.gap_from = None
        self.last_write = now

    async def drain(self) -> None:
        """Until the client has read enough, within the write timeout."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await self.connection.drain()
        except (ConnectionError, TimeoutError) as error:
            raise ClientGone(str(error)) from None

    async def end(self, last: bytes) -> None:
        """What is held, ``last`` and the stream's end, in one write (one wakeup of the client, not two), then as
        ``drain``; a client that does not read them within the write timeout has its connection ended."""
        last, self.held = self.held + last, b""
        try:
            full = self.connection.finish(last)
        except ConnectionError as error:
            raise ClientGone(str(error)) from None
        if full:
            try:
                await self.drain()
            except ClientGone:
                self.connection.abort()
                raise

    def broke(self) -> None:
        if self.gap_from is None:
            self.gap_from = self.last_write


async def relay(
    backend: Backend,
    *,
    path: str,
    body: bytes,
    headers: bytes,
    splicer: Splicer,
    client: ClientStream,
    timeouts: TimeoutSettings,
    mover: Mover,
    comment: bytes = b"",
) -> End | Rejected:
    """One backend's answer to ``path``, ``body`` and ``headers`` (header lines, as ``forwarded_lines`` makes them),
    relayed to ``client`` until it ends; raises ClientGone when the client does.

    ``mover`` may end the answer early (the backend's node is about to go); the caller tells that from a break.
    """
    backend.open_streams += 1
    answer: http1.Answer | None = None
    whole = False  # the stream ended whole: its connection may be kept for the next
    try:
        sent = await _sent(backend, path, body, headers, timeouts, mover)
        if isinstance(sent, Broken):
            return sent
        answer = sent
        if answer.status >= 500:
            return Broken("server_error", f"HTTP {answer.status}")
        if answer.status != 200:  # the caller tells a refused field, and a refused continuation, from the rest
            return Rejected(answer.status, forwarded(answer.headers), await answer.read())
        if not answer.headers.get("Content-Type", "").startswith("text/event-stream"):
            return Broken("garbage", f"Content-Type {answer.headers.get('Content-Type')!r}")
        client.start(answer.headers)
        if comment:
            await client.write(comment, content=False)
        end = await _events(answer, splicer, client, mover)
        whole = isinstance(end, Finished)
        if whole:
            backend.failing = backend.refused = False
        elif isinstance(end, Broken) and end.cause in ("error_event", "abort"):
            backend.failing = True  # its engine may have died
        return end
    except (ClientGone, asyncio.CancelledError):
        raise
    except http1.BadAnswer as error:
        return Broken("garbage", str(error))
    except OSError as reset:
        return Broken("reset", str(reset) or type(reset).__name__)
    finally:
        mover.attach(None)
        if answer is not None:
            if whole and not mover.moved:
                answer.release(backend.kept.keep)
            else:
                answer.close()
        backend.open_streams -= 1


async def _sent(
    backend: Backend, path: str, body: bytes, headers: bytes, timeouts: TimeoutSettings, mover: Mover
) -> http1.Answer | Broken:
    """The request sent and the answer's head read: on the backend's newest idle connection where it has one, else
    on a new one (Broken where none is made). A kept connection that ends before a byte of the answer was closed by
    the backend as the request went (its idle timeout): the request goes again, once, on a new connection. The
    answer is ``mover``'s from the request on: a kept connection to a node that died without a word stays open, and
    a stream waiting on it is moved as a silent one is (gateway/stalls.py). Raises as ``relay`` handles."""
    if (kept := backend.kept.take()) is not None:
        try:
            return await _send(http1.Answer(kept, backend.url), path, body, headers, mover)
        except http1.Unanswered:
            if mover.moved:
                raise
    try:
        answer = await http1.connect(backend.url, connect_s=timeouts.connect_s)
    except TimeoutError:
        return Broken("timeout", f"no connection within {timeouts.connect_s} s")
    except OSError as error:
        return Broken("unavailable", str(error) or type(error).__name__)
    backend.refused = False  # it takes connections again (restarted): a pause in its streams is not a stall yet
    return await _send(answer, path, body, headers, mover)


async def _send(answer: http1.Answer, path: str, body: bytes, headers: bytes, mover: Mover) -> http1.Answer:
    mover.attach(answer)  # from here its read timeout bounds the silence, the answer's head's wait included
    try:
        await answer.send(path, body, headers, keep_alive=True)
    except BaseException:
        mover.attach(None)
        answer.close()
        raise
    return answer


async def _events(answer: http1.Answer, splicer: Splicer, client: ClientStream, mover: Mover) -> End:
    events = _Events(splicer, client, mover)
    while await answer.deliver(events.take):
        if events.end is not None:
            return events.end
        await client.drain()
    if (end := events.close()) is not None:
        return end
    if events.parser.junk:
        return Broken("garbage", f"{events.parser.junk} lines that are not server-sent events")
    return Broken("reset", "the stream closed before its end")


class _Events:
    """One backend's events through the splicer to the client, as the backend's bytes are read: in the read's own
    callback, so a chunk costs no task switch."""

    __slots__ = ("client", "end", "mover", "parser", "splicer")

    def __init__(self, splicer: Splicer, client: ClientStream, mover: Mover) -> None:
        self.parser = SseParser()
        self.splicer = splicer
        self.client = client
        self.mover = mover
        self.end: End | None = None

    def take(self, data: bytes) -> bool:
        """Relay the events ``data`` completes, in one write; True where the relay must wait: the stream ended, or the
        client's buffer is full. Raises ClientGone."""
        now = time.monotonic()
        mover = self.mover  # what Mover.heard does, here: every read of every stream comes this way
        mover.heard_at = now
        mover.reads += 1
        if self.parser.idle and (out := self.splicer.by_shape(data)) is not None:
            client = self.client  # most reads: one token chunk's event, read by the stream's shape
            if client.gap_from is not None:
                return client.send(out, now=now)
            client.last_write = now  # what ClientStream.send does without a gap to tell
            try:
                return client.connection.send(out)
            except ConnectionError as error:
                raise ClientGone(str(error)) from None
        try:
            events = self.parser.feed(data)
        except EventTooLarge as large:
            self.end = Broken("garbage", str(large))
            return True
        return self._relay(events, now)

    def close(self) -> End | None:
        """How the stream ended, from the events a CR held back at its end."""
        self._relay(self.parser.close(), time.monotonic())
        return self.end

    def _relay(self, events: list[bytes], now: float) -> bool:
        out = []
        for data in events:
            step = self.splicer.accept(data)
            if step.out:
                out.append(step.out)
            if step.end is not None:
                self.end = step.end
                break
        if not out:
            return self.end is not None
        if isinstance(self.end, Finished):  # the caller ends the stream next: one write for both
            self.client.hold(b"".join(out), now)
            return True
        return self.client.send(b"".join(out), now=now) or self.end is not None
