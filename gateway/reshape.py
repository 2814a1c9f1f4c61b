"""A completions chunk as the chat chunk vLLM would have streamed for the same tokens: pure, no I/O.

A chat continues exactly only by token ids, and vLLM takes token ids as a prompt only on ``/v1/completions``: the
chat's rendered prompt ids (which vLLM returns with ``return_token_ids``) + the ids generated so far go there, and
its chunks reach the client in the chat's shape. Field order and nulls are vLLM 0.32.0's (measured): a token's
choice is ``index, delta, logprobs, finish_reason`` (``stop_reason`` only with a finish), then ``token_ids``.
"""

from __future__ import annotations

from typing import Any


def as_chat(chunk: dict[str, Any], *, top_logprobs: int) -> dict[str, Any]:
    """``chunk`` (a ``text_completion`` chunk) as a ``chat.completion.chunk``; unknown top-level fields are kept."""
    out: dict[str, Any] = {key: chunk.get(key) for key in ("id", "object", "created", "model")}
    out["object"] = "chat.completion.chunk"
    out["choices"] = [_choice(c, top_logprobs) for c in chunk.get("choices", ()) if isinstance(c, dict)]
    for key, value in chunk.items():
        if key not in out:
            out[key] = value
    return out


def _choice(choice: dict[str, Any], top_logprobs: int) -> dict[str, Any]:
    finish = choice.get("finish_reason")
    out: dict[str, Any] = {
        "index": choice.get("index", 0),
        "delta": {"content": choice.get("text") or ""},
        "logprobs": chat_logprobs(choice.get("logprobs"), top=top_logprobs),
        "finish_reason": finish,
    }
    if finish is not None:
        out["stop_reason"] = choice.get("stop_reason")
    out["token_ids"] = choice.get("token_ids")
    return out


def chat_logprobs(logprobs: Any, *, top: int) -> dict[str, Any] | None:
    """Completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs`` as one dict per token) in the chat's
    shape (``content``: one entry per token with its UTF-8 ``bytes`` and a ranked ``top_logprobs`` list).

    The completions dict keys alternatives by their text, so alternatives with the same text (several partial
    characters are all "") arrive as one: the chat list then has fewer entries than the engine would have sent.
    """
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    content = []
    for index, token in enumerate(tokens):
        alternatives = tops[index] if index < len(tops) and isinstance(tops[index], dict) else {}
        ranked = sorted(alternatives.items(), key=lambda item: -float(item[1]))[:top]
        content.append(
            {
                **_entry(str(token), values[index] if index < len(values) else None),
                "top_logprobs": [_entry(str(text), value) for text, value in ranked],
            }
        )
    return {"content": content}


def _entry(token: str, logprob: Any) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode(errors="surrogatepass"))}
