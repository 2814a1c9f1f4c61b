"""vLLM's OpenAI-compatible response shapes, field for field, as the fake engine writes them.

Sources (vllm-project/vllm): ``vllm/entrypoints/openai/completion/serving.py`` (``completion_stream_generator``:
chunks dumped with ``exclude_unset=True``, so explicitly passed ``None`` fields stay; the trailing usage chunk with
``exclude_none=True`` and ``choices: []``), ``vllm/entrypoints/openai/chat_completion/serving.py``
(``chat_completion_stream_generator``: a first chunk per choice with ``delta: {role, content: ""}``, the role being
the last message's when ``add_generation_prompt`` is false; ``finish_reason`` on the chunk of the last token;
``stop_reason`` only there), ``vllm/entrypoints/openai/engine/serving.py`` (``create_streaming_error_response``:
``{"error": {"message", "type", "param", "code"}}`` followed by ``data: [DONE]``), and ``UsageInfo``'s field order
(``prompt_tokens``, ``total_tokens``, ``completion_tokens``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def error_body(message: str, *, kind: str = "BadRequestError", code: int = 400) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


@dataclass(frozen=True)
class Stream:
    """What every chunk of one response repeats: its id, creation time, model and whether token ids go out."""

    chat: bool
    id: str
    created: int
    model: str
    token_ids: bool

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}

    def first(self, *, role: str, prompt_ids: list[int]) -> bytes | None:
        """The chat role delta (completions have none; their prompt ids ride on the first token's chunk)."""
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        chunk = self._envelope([choice])
        chunk["prompt_token_ids"] = prompt_ids if self.token_ids else None
        chunk["prompt_text"] = None
        return sse(chunk)

    def token(
        self, text: str, ids: list[int], *, finish: str | None, stop: str | None, prompt_ids: list[int] | None
    ) -> bytes:
        """One engine step: its text, and ``finish_reason`` when it is the last."""
        token_ids = ids if self.token_ids else None
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop
            choice["token_ids"] = token_ids
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
            choice["prompt_token_ids"] = prompt_ids if self.token_ids else None
            choice["token_ids"] = token_ids
        return sse(self._envelope([choice]))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        chunk = self._envelope([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(chunk)

    def whole(
        self, text: str, *, finish: str, stop: str | None, prompt_ids: list[int], ids: list[int]
    ) -> dict[str, Any]:
        """The non-streamed response: one choice with all the text, and usage."""
        choice: dict[str, Any]
        if self.chat:
            message = {"role": "assistant", "content": text, "tool_calls": []}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
            choice["prompt_logprobs"] = None
        if self.token_ids:
            choice["prompt_token_ids"] = prompt_ids
            choice["token_ids"] = ids
        body = self._envelope([choice])
        body["object"] = "chat.completion" if self.chat else "text_completion"
        body["usage"] = usage(len(prompt_ids), len(ids))
        return body


class InvalidRequest(ValueError):
    """A request vLLM would answer with a 400."""


@dataclass(frozen=True)
class Job:
    """One generation as the engine sees it, read from a completions or chat body."""

    prompt_ids: list[int]
    max_tokens: int
    stop: frozenset[str]
    stream: bool
    include_usage: bool
    token_ids: bool
    role: str  # the chat role of the reply


def _stop(body: dict[str, Any]) -> frozenset[str]:
    stop = body.get("stop")
    if stop is None:
        return frozenset()
    if isinstance(stop, str):
        return frozenset({stop})
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return frozenset(stop)
    raise InvalidRequest("stop must be a string or a list of strings")


def _prompt_ids(body: dict[str, Any], *, chat: bool) -> tuple[list[int], str]:
    from simulate.fakes.tokens import ChatError, render_chat, tokenize

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise InvalidRequest("messages must be a list")
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        try:
            text = render_chat(
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(body.get("continue_final_message", False)),
            )
        except ChatError as error:
            raise InvalidRequest(str(error)) from None
        return tokenize(text), "assistant" if add_generation_prompt else str(messages[-1]["role"])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenize(prompt), "assistant"
    if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt):
        return list(prompt), "assistant"  # token ids, as vLLM accepts them
    raise InvalidRequest("prompt must be a string or a list of token ids (one prompt)")


def read_job(body: Any, *, chat: bool, max_model_len: int) -> Job:
    """The generation a body asks for; raises InvalidRequest where vLLM answers 400.

    Defaults follow vLLM: completions ``max_tokens`` 16; chat ``max_completion_tokens`` (else ``max_tokens``), else
    what is left of the model's context.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    prompt_ids, role = _prompt_ids(body, chat=chat)
    room = max(0, max_model_len - len(prompt_ids))
    limit = body.get("max_completion_tokens") if chat else None
    limit = body.get("max_tokens") if limit is None else limit
    if limit is None:
        limit = room if chat else 16
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise InvalidRequest("max_tokens must be at least 1")
    if limit > room:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    return Job(
        prompt_ids=prompt_ids,
        max_tokens=limit,
        stop=_stop(body),
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)) and bool(body.get("stream", False)),
        token_ids=bool(body.get("return_token_ids", False)),
        role=role,
    )
