"""What a parsed chat's continuation asks the backend it continues on: the markers' ids and the text so far.

Both on vLLM's own ``/tokenize`` and ``/detokenize`` (vllm/entrypoints/serve/tokenize/api_router.py), asked only when
a stream broke, each bounded by the connect timeout; None where the backend does not answer as vLLM does (the stream
is then cut, not continued wrong).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from gateway.parsed import THINK_TEXT, TURNS_TEXT, markers_from
from gateway.reasoning import Markers, Piece

# A character is at most 4 bytes of UTF-8, so at most 3 of the last tokens hold only part of it.
PARTIAL_TOKENS = 3
REPLACEMENT = "\ufffd"  # what vLLM's decoder makes of a character it has only part of


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> Any:
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
            return json.loads(await answer.read()) if answer.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


async def markers(
    session: aiohttp.ClientSession, url: str, *, model: object, timeout_s: float, turns: bool = False
) -> Markers | None:
    """The reasoning markers' ids in the model's vocabulary, and with ``turns`` (qwen3) its turn boundaries'."""
    think = await _tokens(session, url, THINK_TEXT, model=model, timeout_s=timeout_s)
    if think is None:
        return None
    boundaries = await _tokens(session, url, TURNS_TEXT, model=model, timeout_s=timeout_s) if turns else None
    return markers_from(think, boundaries or ())


async def _tokens(
    session: aiohttp.ClientSession, url: str, text: str, *, model: object, timeout_s: float
) -> list[int] | None:
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    said = await _post(session, url + "/tokenize", body, timeout_s)
    ids = said.get("tokens") if isinstance(said, dict) else None
    return ids if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else None


async def generated(
    session: aiohttp.ClientSession, url: str, ids: Sequence[int], *, model: object, timeout_s: float
) -> Piece | None:
    """The longest start of ``ids`` that ends a character, as one piece with its text: what the replay is fed
    before the continuation, which goes on from there (the tokens after it brought the client no text: vLLM
    streams a character once its last token came)."""
    ids = list(ids)
    for _ in range(PARTIAL_TOKENS + 1):
        if not ids:
            return Piece("", ())
        said = await _post(session, url + "/detokenize", {"model": model, "tokens": ids}, timeout_s)
        text = said.get("prompt") if isinstance(said, dict) else None
        if not isinstance(text, str):
            return None
        if not text.endswith(REPLACEMENT):
            return Piece(text, tuple(ids))
        ids.pop()
    return None
