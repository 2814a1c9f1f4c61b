"""A request's head as the gateway's server reads it: the request line, the headers, and how its body is framed.

Pure: bytes in, a ``Request`` (or ``BadRequest`` with the status to answer) out.
"""

from __future__ import annotations

import re

from multidict import CIMultiDict

_TOKEN_CHARS = r"!#$%&'*+\-.^_`|~0-9A-Za-z"  # RFC 9110 section 5.6.2
# Control characters (RFC 9110 section 5.5 allows none but HTAB in a field value): a bare LF passed on to a backend
# would be a line break there, a header the client smuggled into the gateway's own request.
_CONTROL_CHARS = r"\x00-\x08\x0a-\x1f\x7f"
_TOKEN = re.compile(f"[{_TOKEN_CHARS}]+")
_CONTROL = re.compile(f"[{_CONTROL_CHARS}]")
_DECIMAL = re.compile(r"[0-9]{1,18}")
# Header lines as ``header_lines`` takes them, all at once: a token, a colon, a value without a control character,
# CRLF between lines. A line break can only be that CRLF, so a field found after an LF starts a line.
_LINE = f"[{_TOKEN_CHARS}]+:[^{_CONTROL_CHARS}]*".encode()
_LINES = re.compile(_LINE + rb"(?:\r\n" + _LINE + rb")*")
_FRAMING = re.compile(rb"\n(connection|content-length|transfer-encoding|expect):([^\r]*)")  # in lowercase lines


class BadRequest(Exception):
    """The client's bytes are not a request this server takes; ``status`` is its answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Request:
    """One request, read whole."""

    __slots__ = ("body", "chunked", "closes", "head", "method", "target")

    def __init__(self, *, method: str, target: str, head: bytes, closes: bool, chunked: bool) -> None:
        self.method = method
        self.target = target  # the path and query
        self.head = head  # the header lines, as received
        self.closes = closes  # the connection ends with this answer (HTTP/1.0, or Connection: close)
        self.chunked = chunked  # a stream to it is chunked (HTTP/1.1), so a cut one is told from a whole one
        self.body = b""

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]

    @property
    def headers(self) -> CIMultiDict[str]:
        """Parsed again at each call: a whole request reads them once, a stream passes its lines on as they are."""
        return header_lines(self.head)


def header_lines(head: bytes) -> CIMultiDict[str]:
    """Header lines (CRLF between them); raises BadRequest for a line that is not one (obsolete folding included)."""
    headers: CIMultiDict[str] = CIMultiDict()
    for line in head.decode("latin-1").split("\r\n") if head else ():
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            raise BadRequest(400, f"not a header line: {line[:80]!r}")
        headers.add(name, value.strip(" \t"))
    return headers


def parse_head(data: bytes) -> tuple[Request, int | None, bool]:
    """A request's head (without its blank line): the request, its body's length (None: chunked), and whether it
    expects ``100 Continue`` before sending the body; raises BadRequest.

    The header lines are checked in one match and the four fields the framing needs read in one search: a stream's
    request is passed on as its lines (``relay.forwarded_lines``), so no mapping is built for it here."""
    line, _, head = data.partition(b"\r\n")
    parts = line.decode("latin-1").split(" ")
    method, target, version = parts if len(parts) == 3 else ("", "", "")
    if (
        not _TOKEN.fullmatch(method)
        or not target.startswith("/")
        or _CONTROL.search(target)
        or version not in ("HTTP/1.1", "HTTP/1.0")
    ):
        raise BadRequest(400, f"not a request line: {line[:80]!r}")
    if head and not _LINES.fullmatch(head):
        bad = next(line for line in head.split(b"\r\n") if not _LINES.fullmatch(line))
        raise BadRequest(400, f"not a header line: {bad.decode('latin-1')[:80]!r}")
    fields: dict[bytes, list[str]] = {b"connection": [], b"content-length": [], b"transfer-encoding": [], b"expect": []}
    for name, value in _FRAMING.findall(b"\n" + head.lower()):  # the four fields' values are read in lowercase
        fields[name].append(value.strip(b" \t").decode("latin-1"))
    options = {token.strip().lower() for token in ",".join(fields[b"connection"]).split(",")}
    chunked = version == "HTTP/1.1"
    closes = "close" in options or not chunked  # a stream to HTTP/1.0 cannot be chunked: its end is the close
    lengths = set(fields[b"content-length"])
    coding = ",".join(fields[b"transfer-encoding"]).lower().replace(" ", "")
    if coding and lengths:  # RFC 9112 section 6.1: a request with both is an attempt at smuggling
        raise BadRequest(400, "both Transfer-Encoding and Content-Length")
    if coding and coding != "chunked":
        raise BadRequest(501, f"Transfer-Encoding {coding!r}")
    length = next(iter(lengths), "0")
    if len(lengths) > 1 or not _DECIMAL.fullmatch(length):
        raise BadRequest(400, f"Content-Length {sorted(lengths)!r}")
    expects = next(iter(fields[b"expect"]), "").lower() == "100-continue"
    request = Request(method=method, target=target, head=head, closes=closes, chunked=chunked)
    return request, None if coding else int(length), expects
