"""What a backend's plain token chunks have in common, learned from one of them, so the next are read without a parse.

vLLM writes every token chunk of a stream as the same bytes around two slots: the token's text and its ids, e.g.
``data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"SLOT",
"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":[SLOT]}]}`` and a blank
line. A shape is those bytes, learned from a chunk the splicer has parsed. A later event equal to it outside the
slots, with a text slot that is plain UTF-8 (no escape, no control character: a JSON string as it is) and an ids slot
of one decimal id, is a chunk whose parse would differ from the learned one in the text and the id alone: the
splicer takes both from the slots and relays the bytes (the ids nulled where it hides them) without parsing. Any
other event (the first, a finish, a role, an escape, logprobs, several ids, other spacing) is parsed in full, as
before. The shape holds the event's framing (one ``data:`` line, a blank one) with no line break inside, so a read
of the backend's that matches it is that one event whole: the relay takes it without the event parser.

Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gateway.token_ids import hide

# A JSON string's content that means its own bytes (no escape, no control character), up to its closing quote.
_PLAIN = re.compile(rb'[^"\\\x00-\x1f]*(?=")')
_ID_DIGITS = 18  # an id's digits at most: one the splicer's 8-byte ids hold
_CLOSE, _ZERO = ord("]"), ord("0")
_SPACE = b" \t\n\r"


@dataclass(frozen=True, slots=True)
class Shape:
    """A chunk's event around its slots: ``prefix`` (``data: `` and the chunk) up to the text's first byte,
    ``middle`` from the text's closing quote to the ids' first digit (or to the end, without ids), ``tail`` after the
    ids' ``]`` (the blank line included)."""

    prefix: bytes
    middle: bytes
    tail: bytes
    ids: bool  # the chunk has an ids slot

    def match(self, data: bytes) -> tuple[bytes, int | None, int] | None:
        """The text (its UTF-8 bytes) and token id (None without ids) of ``data``, one event, and where its ids' ``[``
        is; None where it is not a chunk of this shape."""
        if not data.startswith(self.prefix):
            return None
        start = len(self.prefix)
        plain = _PLAIN.match(data, start)
        if plain is None or not data.startswith(self.middle, close := plain.end()):
            return None
        text = data[start:close]
        if not text.isascii() and not _utf8(text):
            return None
        at = close + len(self.middle)
        if not self.ids:
            return (text, None, at) if at == len(data) else None
        end = len(data) - len(self.tail) - 1  # where the ids' "]" is
        token = data[at:end] if at < end else b""  # one id in JSON (no leading zero), that 8 bytes hold
        if not (token.isdigit() and len(token) <= _ID_DIGITS and data[end] == _CLOSE and data.endswith(self.tail)):
            return None
        if token[0] == _ZERO and len(token) > 1:
            return None
        return text, int(token), at - 1


def _utf8(text: bytes) -> bool:
    try:
        text.decode()
    except UnicodeDecodeError:  # orjson refuses it; json reads encoded surrogates: the full parse decides
        return False
    return True


def learn(data: bytes, choice: dict[str, Any], *, chat: bool) -> Shape | None:
    """The shape of ``data``, a chunk whose parse is one choice ``choice`` (index 0) that the splicer relayed as it
    came and that changed nothing but the text and token count; None where its chunks cannot be read from bytes."""
    if b"\\" in data or b"\n" in data or b"\r" in data:
        return None  # an escaped key could be any key; a line break would be several lines of one event
    if choice.get("finish_reason") is not None or choice.get("prompt_token_ids") is not None:
        return None  # once a stream
    if chat and (b'"role"' in data or not _plain_delta(choice.get("delta"))):
        return None
    ids = choice.get("token_ids")
    if isinstance(ids, list) and (len(ids) != 1 or type(ids[0]) is not int):
        return None
    key = b'"content":' if chat else b'"text":'
    if data.count(key) != 1 or (isinstance(ids, list) and data.count(b'"token_ids":') != 1):
        return None  # a slot must be the choice's own key, found once
    start = _value(data, data.find(key) + len(key), b'"')
    if start < 0:
        return None
    close = data.find(b'"', start)
    if not isinstance(ids, list):
        shape = Shape(b"data: " + data[:start], data[close:] + b"\n\n", b"", ids=False)
    else:
        at = _value(data, data.find(b'"token_ids":') + len(b'"token_ids":'), b"[")
        end = data.find(b"]", at)
        if not close < at <= end:
            return None
        shape = Shape(b"data: " + data[:start], data[close:at], data[end + 1 :] + b"\n\n", ids=True)
    return shape if _reads_back(shape, data, choice, chat=chat) else None


def _plain_delta(delta: Any) -> bool:
    """A chat delta of content alone: no role, tool call or reasoning, whose handling the splicer must see."""
    if not isinstance(delta, dict) or "role" in delta:
        return False
    return not (delta.get("tool_calls") or delta.get("reasoning_content") or delta.get("reasoning"))


def _value(data: bytes, at: int, opening: bytes) -> int:
    """Where the value after a key's colon at ``at`` starts, just past its ``opening``; -1 where it is another."""
    while at < len(data) and data[at] in _SPACE:
        at += 1
    return at + 1 if data[at : at + 1] == opening else -1


def _reads_back(shape: Shape, data: bytes, choice: dict[str, Any], *, chat: bool) -> bool:
    """The shape reads its own chunk as the parse did, and hides its ids as ``token_ids.hide`` does."""
    event = b"data: " + data + b"\n\n"
    slots = shape.match(event)
    if slots is None:
        return False
    text, token, ids_at = slots
    piece = choice["delta"].get("content") if chat else choice.get("text")
    ids = choice.get("token_ids")
    if not isinstance(piece, str) or text != piece.encode(errors="surrogatepass"):
        return False
    if token != (ids[0] if isinstance(ids, list) else None):
        return False
    return b"data: " + hide(data) + b"\n\n" == (hidden(shape, event, ids_at) if shape.ids else event)


def hidden(shape: Shape, event: bytes, ids_at: int) -> bytes:
    """``event``, a chunk of ``shape`` with ids, with its ids ``null`` (what ``token_ids.hide`` makes of it)."""
    return event[:ids_at] + b"null" + shape.tail
