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
# vLLM 0.32.0 (measured): the chunk of the last token, the usage chunk and whole responses carry a fingerprint.
FINGERPRINT = "vllm-0.32.0-fake"


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def error_body(
    message: str, *, kind: str = "BadRequestError", code: int = 400, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def chunk_size(first_token: int, merge_steps: int) -> int:
    """How many engine steps go out in the chunk that starts with ``first_token`` (1 to ``merge_steps``): a function
    of the token, so a stream and its continuation merge at other places, as two loaded servers would."""
    return 1 + (first_token * 0x9E3779B1 >> 5) % merge_steps


@dataclass(frozen=True)
class Stream:
    """What every chunk of one response repeats: its id, creation time, model and whether token ids go out."""

    chat: bool
    id: str
    created: int
    model: str
    token_ids: bool
    include_usage: bool = False

    @property
    def object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}

    def first(self, *, role: str, prompt_ids: list[int], index: int = 0) -> bytes | None:
        """The chat role delta (completions have none; their prompt ids ride on the first token's chunk)."""
        if not self.chat:
            return None
        choice = {"index": index, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        chunk = self._envelope([choice])
        chunk["prompt_token_ids"] = prompt_ids if self.token_ids else None
        chunk["prompt_text"] = None
        return sse(chunk)

    def token(
        self,
        text: str,
        ids: list[int],
        *,
        finish: str | None,
        stop: str | None,
        prompt_ids: list[int] | None,
        index: int = 0,
        delta: dict[str, Any] | None = None,
    ) -> bytes:
        """One engine step of choice ``index``: its text (or, from a chat's parsers, its ``delta``), and
        ``finish_reason`` when it is the last."""
        token_ids = ids if self.token_ids else None
        choice: dict[str, Any]
        if self.chat:
            delta = {"content": text} if delta is None else delta
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop
            choice["token_ids"] = token_ids
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": stop}
            choice["prompt_token_ids"] = prompt_ids if self.token_ids else None
            choice["token_ids"] = token_ids
        chunk = self._envelope([choice])
        if finish is not None and not self.include_usage:  # else the usage chunk carries it
            chunk["system_fingerprint"] = FINGERPRINT
        return sse(chunk)

    def usage(self, prompt_tokens: int, completion_tokens: int, *, reasoning_tokens: int | None = None) -> bytes:
        """The usage chunk; with a reasoning parser, its count of reasoning tokens (``_make_completion_tokens_details``
        in the chat server: set only where ``--reasoning-parser`` is)."""
        chunk = self._envelope([])
        chunk["usage"] = usage(prompt_tokens, completion_tokens)
        if reasoning_tokens is not None:
            chunk["usage"]["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        chunk["system_fingerprint"] = FINGERPRINT
        return sse(chunk)

    def whole(self, outputs: list[Output], *, prompt_ids: list[int]) -> dict[str, Any]:
        """The non-streamed response: one choice per output with all its text, and usage (the prompt counted once,
        every choice's tokens), with every field vLLM 0.32.0 sends (its pydantic models dumped whole: unset fields
        as null)."""
        body = self._envelope([self._whole_choice(index, o, prompt_ids) for index, o in enumerate(outputs)])
        body["object"] = "chat.completion" if self.chat else "text_completion"
        body.update(service_tier=None, system_fingerprint=FINGERPRINT)
        generated = sum(len(o.ids) for o in outputs)
        body["usage"] = {**usage(len(prompt_ids), generated), "prompt_tokens_details": None}
        counted = [o.reasoning_tokens for o in outputs if o.reasoning_tokens is not None]
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": sum(counted)} if counted else None
        if self.chat:
            body.update(prompt_logprobs=None, prompt_token_ids=prompt_ids if self.token_ids else None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return body

    def _whole_choice(self, index: int, output: Output, prompt_ids: list[int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        ids = output.ids if self.token_ids else None
        if self.chat and output.parsed is not None:  # ChatMessage: empty tool_calls left out, reasoning last
            parsed, finish = output.parsed, "tool_calls" if output.parsed["tool_calls"] else output.finish
            message = {"role": "assistant", "content": parsed["content"], **dict.fromkeys(CHAT_MESSAGE_NULLS[:-1])}
            choice["message"] = message | ({"tool_calls": parsed["tool_calls"]} if parsed["tool_calls"] else {})
            choice["message"]["reasoning"] = parsed["reasoning"]
            choice.update(logprobs=None, finish_reason=finish, stop_reason=output.stop)
            choice.update(token_ids=None if parsed["hidden"] else ids, routed_experts=None)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": output.text, **dict.fromkeys(CHAT_MESSAGE_NULLS)}
            choice.update(logprobs=None, finish_reason=output.finish, stop_reason=output.stop)
            choice.update(token_ids=ids, routed_experts=None)
        else:
            choice.update(text=output.text, logprobs=None, finish_reason=output.finish, stop_reason=output.stop)
            choice.update(token_ids=ids, prompt_logprobs=None)
            choice.update(prompt_token_ids=prompt_ids if self.token_ids else None, routed_experts=None)
        return choice


@dataclass(frozen=True)
class Output:
    """One choice of a whole response."""

    text: str
    finish: str
    stop: str | None
    ids: list[int]
    # From a chat's parsers (reasoning_frames.whole): the message's fields instead of the text as content, and the
    # reasoning tokens the usage counts.
    parsed: dict[str, Any] | None = None
    reasoning_tokens: int | None = None


CHAT_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")


class InvalidRequest(ValueError):
    """A request vLLM would answer with a 400: the body's field (``param``) and the error's type.

    vLLM 0.32.0 (measured): a field of the wrong JSON type fails its request model's validation, answered with type
    ``Bad Request`` and ``param`` ``body.<field>``; a value it checks itself gets ``BadRequestError``."""

    def __init__(self, message: str, *, param: str | None = None, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.param = param
        self.kind = kind


def _wrong_type(field: str, expected: str) -> InvalidRequest:
    return InvalidRequest(f"body.{field}: Input should be {expected}", param=f"body.{field}", kind="Bad Request")


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
    n: int = 1  # choices, each its own generation
    skip_special_tokens: bool = True
    tools: bool = False  # tools offered (given, and tool_choice not "none")
    include_reasoning: bool = True


def _stop(body: dict[str, Any]) -> frozenset[str]:
    stop = body.get("stop")
    if stop is None:
        return frozenset()
    if isinstance(stop, str):
        return frozenset({stop})
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return frozenset(stop)
    raise _wrong_type("stop", "a valid string or a valid list")


def _prompt_ids(body: dict[str, Any], *, chat: bool, thinking: bool = False) -> tuple[list[int], str]:
    from simulate.fakes import thinking as model
    from simulate.fakes.tokens import ChatError, render_chat, tokenize

    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise _wrong_type("messages", "a valid list")
        add_generation_prompt = bool(body.get("add_generation_prompt", True))
        continue_final_message = bool(body.get("continue_final_message", False))
        try:
            if thinking:
                text = model.render(
                    messages,
                    tools=model.tools_of(body.get("tools")),
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
            else:
                text = render_chat(
                    messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message
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
    raise _wrong_type("prompt", "a valid string or a valid list (one prompt)")


def token_id_prompt(body: dict[str, Any]) -> bool:
    """Whether a completions body's prompt is token ids (one list of them, or a batch of one)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(i, int) for i in prompt)


def read_job(
    body: Any, *, chat: bool, max_model_len: int, token_ids: str = "returned", parsers: ChatParsers | None = None
) -> Job:
    """The generation a body asks for; raises InvalidRequest where vLLM answers 400 (and, with ``token_ids``
    "refused", where a server that forbids unknown fields refuses ``return_token_ids``). With ``parsers`` the chat
    is the thinking model's (simulate/fakes/thinking.py).

    Defaults follow vLLM: completions ``max_tokens`` 16; chat ``max_completion_tokens`` (else ``max_tokens``), else
    what is left of the model's context.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    if token_ids == "refused" and "return_token_ids" in body:
        raise InvalidRequest("return_token_ids: extra inputs are not permitted", param="return_token_ids")
    prompt_ids, role = _prompt_ids(body, chat=chat, thinking=parsers is not None)
    room = max(0, max_model_len - len(prompt_ids))
    limit = body.get("max_completion_tokens") if chat else None
    limit = body.get("max_tokens") if limit is None else limit
    if limit is None:
        limit = room if chat else 16
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if limit > max_model_len:
        raise InvalidRequest(
            f"max_tokens={limit} cannot be greater than max_model_len={max_model_len}. Please request fewer output "
            f"tokens. (parameter=max_tokens, value={limit})",
            param="max_tokens",
        )
    if limit > room:
        raise InvalidRequest(f"This model's maximum context length is {max_model_len} tokens.")
    n = body.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool):
        raise _wrong_type("n", "a valid integer")
    if n < 1:
        raise InvalidRequest(f"n must be at least 1, got {n}.", param="n")
    if _greedy(body) and n > 1:
        raise InvalidRequest(f"n must be 1 when using greedy sampling, got {n}.")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidRequest("stream_options must be an object")
    return Job(
        prompt_ids=prompt_ids,
        max_tokens=limit,
        stop=_stop(body),
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)) and bool(body.get("stream", False)),
        token_ids=token_ids == "returned" and bool(body.get("return_token_ids", False)),
        role=role,
        n=n,
        **_parsed(body, chat=chat, parsers=parsers),
    )


@dataclass(frozen=True)
class ChatParsers:
    """The engine's ``--reasoning-parser`` and ``--tool-call-parser`` (with ``--enable-auto-tool-choice``)."""

    reasoning: str | None
    tools: str | None


def _parsed(body: dict[str, Any], *, chat: bool, parsers: ChatParsers | None) -> dict[str, bool]:
    """What the request's parsers make of it: their ``adjust_request`` turns ``skip_special_tokens`` off for qwen3
    (vllm/parser/engine/parser_engine.py) and for hermes with tools offered (hermes_tool_parser.py)."""
    skip = body.get("skip_special_tokens", True) is not False
    tools = chat and bool(body.get("tools")) and body.get("tool_choice", "auto") != "none"
    if chat and parsers is not None and (parsers.reasoning == "qwen3" or (parsers.tools == "hermes" and tools)):
        skip = False
    shown = body.get("include_reasoning") is not False
    return {"skip_special_tokens": skip, "tools": tools, "include_reasoning": shown}


def _greedy(body: dict[str, Any]) -> bool:
    """vLLM samples greedily below a temperature of 1e-5 (its ``_SAMPLING_EPS``); unset means 1.0."""
    temperature = body.get("temperature")
    return isinstance(temperature, int | float) and temperature < 1e-5
