"""The token ids the gateway asks a backend for, for itself: asking, noticing a refusal, hiding them from the client.

Only token ids continue a stream exactly: re-tokenising the text so far gives other ids on a real tokenizer. vLLM
returns them with ``return_token_ids: true`` (``token_ids`` per choice, ``prompt_token_ids`` on the first chunk). A
client that did not ask gets the chunks as vLLM sends them without the field: the same keys, with ``null``.
"""

from __future__ import annotations

import json
import re
from typing import Any

FIELD = "return_token_ids"
_FIELD_BYTES = FIELD.encode()
_WHITESPACE = b" \t\r\n"  # JSON's (RFC 8259 section 2)
# A key can only match where it is one: inside a JSON string every quote is escaped. Values are lists of ints.
_IDS = re.compile(rb'"(prompt_)?token_ids"\s*:\s*\[[-\d,\s]*\]')
_NULLED = rb'"\1token_ids":null'


def asked(body: dict[str, Any]) -> bool:
    """Whether the client asked for token ids itself."""
    return body.get(FIELD) is True


def with_ids(body: dict[str, Any], raw: bytes) -> bytes:
    """The request as the client sent it (``raw``, which parsed as ``body``), asking for token ids too.

    Where it has no such field, the field goes in first and the client's bytes follow as they came: no cost that
    grows with a long prompt (a 130 KB chat written again took 229 µs, the insertion 6). Else it is written again.
    """
    start = len(raw) - len(raw.lstrip(_WHITESPACE))
    if FIELD not in body and raw[start : start + 1] == b"{":
        rest = raw[start + 1 :]
        comma = b"" if rest.lstrip(_WHITESPACE)[:1] == b"}" else b","
        return b'%b{"%b":true%b%b' % (raw[:start], _FIELD_BYTES, comma, rest)
    return json.dumps({**body, FIELD: True}, separators=(",", ":")).encode()


def refuses_ids(status: int, body: bytes) -> bool:
    """A 4xx that names the field: the backend does not take it (a server that forbids unknown fields)."""
    return status in (400, 422) and _FIELD_BYTES in body


def hide(data: bytes) -> bytes:
    """A chunk's bytes with its token id lists replaced by ``null``; the same bytes when it has none.

    vLLM writes ``"token_ids":[...]`` with no spaces: that is cut out with a find or two per chunk (a regular
    expression costs several times more, on every chunk of every stream); other spacing goes through the expression.
    """
    start = data.find(b'_ids":[')
    if start < 0:
        return _IDS.sub(_NULLED, data) if b'_ids": [' in data else data
    out: list[bytes] = []
    done = 0
    while start >= 0:
        end = data.find(b"]", start)
        if end < 0:
            return data  # not JSON: the splicer says so
        if data[start - 6 : start] == b'"token' or data[start - 13 : start] == b'"prompt_token':
            out += (data[done : start + 6], b"null")
            done = end + 1
        start = data.find(b'_ids":[', end)
    out.append(data[done:])
    return b"".join(out)


def hide_in(chunk: dict[str, Any]) -> None:
    """The same, on a parsed chunk about to be serialised again."""
    for holder in (chunk, *(c for c in chunk.get("choices", ()) if isinstance(c, dict))):
        for key in ("token_ids", "prompt_token_ids"):
            if holder.get(key) is not None:
                holder[key] = None
