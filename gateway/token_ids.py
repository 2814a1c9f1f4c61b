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
# A key can only match where it is one: inside a JSON string every quote is escaped. Values are lists of ints.
_IDS = re.compile(rb'"(prompt_)?token_ids"\s*:\s*\[[-\d,\s]*\]')
_NULLED = rb'"\1token_ids":null'


def asked(body: dict[str, Any]) -> bool:
    """Whether the client asked for token ids itself."""
    return body.get(FIELD) is True


def with_ids(body: dict[str, Any]) -> bytes:
    """The request as the client sent it, asking for token ids too."""
    return json.dumps({**body, FIELD: True}, separators=(",", ":")).encode()


def refuses_ids(status: int, body: bytes) -> bool:
    """A 4xx that names the field: the backend does not take it (a server that forbids unknown fields)."""
    return status in (400, 422) and _FIELD_BYTES in body


def hide(data: bytes) -> bytes:
    """A chunk's bytes with its token id lists replaced by ``null``; the same bytes when it has none (one scan)."""
    if b'token_ids"' not in data:
        return data
    return _IDS.sub(_NULLED, data)


def hide_in(chunk: dict[str, Any]) -> None:
    """The same, on a parsed chunk about to be serialised again."""
    for holder in (chunk, *(c for c in chunk.get("choices", ()) if isinstance(c, dict))):
        for key in ("token_ids", "prompt_token_ids"):
            if holder.get(key) is not None:
                holder[key] = None
