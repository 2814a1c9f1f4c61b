"""When a broken stream may continue elsewhere, and the request that continues it: pure functions of data.

The continuation re-issues the request with what the client already has as part of the prompt, the way NVIDIA
Dynamo's frontend migrates a request (prompt + generated tokens, ``max_tokens`` reduced). Only token ids continue
exactly: on a real tokenizer the text so far, tokenised again, gives other ids (vLLM 0.32.0 and the tiny Llama,
measured: 0 of 8 continued texts equal the uninterrupted one by text, every one by ids). So, where the backend
returned ids (vLLM's ``return_token_ids``):

- completions: ``prompt`` = the prompt's token ids + the generated ids;
- chat: on ``/v1/completions``, ``prompt`` = the chat's rendered prompt ids (vLLM's ``prompt_token_ids``) + the
  generated ids; its chunks are reshaped into the chat's (gateway.reshape);

and, for a backend without ids, the fallback by text:

- completions: ``prompt`` = the original prompt + the text so far;
- chat: the messages + one final assistant message holding the text so far, with ``continue_final_message: true``
  and ``add_generation_prompt: false`` (vLLM renders it with Hugging Face's ``continue_final_message``: the last
  message stays open, so generation carries on inside it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from gateway.parsed import parser_refusal, skips_special_tokens
from gateway.settings import NO_PARSERS, ParserSettings
from gateway.splice import Splicer

COMPLETIONS = "/v1/completions"
# How a stream went on after a break: by ids, by text, or from the start (nothing generated had reached the client).
METHODS = ("token_ids", "text", "restart")
# Chat fields /v1/completions does not have (vllm/entrypoints/openai/chat_completion/protocol.py); the sampling
# fields the two share go on as they came.
CHAT_ONLY = (
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "reasoning_effort",
    "include_reasoning",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "modalities",
    "audio",
    "prediction",
    "store",
    "metadata",
    "web_search_options",
)


@dataclass(frozen=True)
class Continuation:
    path: str
    body: dict[str, Any]
    method: str  # one of METHODS

    @property
    def chat(self) -> bool:
        """Whether its backend answers in the chat's shape."""
        return self.path != COMPLETIONS


# Constrained decoding keeps a grammar state a fresh request would not have: continuing it could break the format.
GUIDED_FIELDS = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"})
REASONS = (
    "multiple_choices",
    "guided",
    "tool_call",
    "reasoning",
    "reasoning_hidden",
    "too_long",
    "unsupported_prompt",
    "limit",
    "no_backend",
)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def refusal_at_start(body: dict[str, Any], *, chat: bool) -> str | None:
    """Why this request can never be continued, whatever happens to its stream (None: it can be)."""
    if _count(body.get("n", 1)) > 1 or _count(body.get("best_of", 1)) > 1 or body.get("use_beam_search"):
        return "multiple_choices"
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return "multiple_choices" if len(prompt) > 1 else None
    if not chat and body.get("echo"):  # the first chunk's text holds the prompt too: the text so far is not known
        return "unsupported_prompt"
    if any(body[name] is not None for name in GUIDED_FIELDS.intersection(body)):
        return "guided"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"):
        return "guided"
    # vLLM decodes a required or named tool call with a JSON schema (serving.py, _get_json_schema_from_tool)
    if (
        chat
        and body.get("tools")
        and (body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict))
    ):
        return "guided"
    return None


def refusal(
    body: dict[str, Any],
    splicer: Splicer,
    *,
    chat: bool,
    max_tokens: int,
    parsers: ParserSettings = NO_PARSERS,
) -> str | None:
    """Why this stream, as far as it got, cannot continue on another backend (None: it can).

    A chat the engine split into reasoning and content, or into tool calls, continues only where the gateway knows
    the parsers and can replay them (gateway.parsed)."""
    if (reason := refusal_at_start(body, chat=chat)) is not None:
        return reason
    if splicer.multiple_choices:
        return "multiple_choices"
    if chat and (reason := parser_refusal(body, parsers, reasoning=splicer.reasoning, tools=splicer.tool_call)):
        return reason
    if chat and (splicer.reasoning or splicer.tool_call) and not by_ids(body, splicer, chat=True):
        return "tool_call" if splicer.tool_call else "reasoning"  # by text, only the content would go on
    if not chat and (splicer.tool_call or splicer.reasoning):
        return "tool_call" if splicer.tool_call else "reasoning"
    if splicer.tokens > max_tokens:
        return "too_long"
    if not chat and _prompt_ids(body, splicer) is None and not isinstance(_single_prompt(body), str):
        return "unsupported_prompt"
    return None


def remaining_tokens(body: dict[str, Any], splicer: Splicer, *, chat: bool) -> int | None:
    """Tokens the continuation may still generate; None when the request set no bound."""
    return _left(body, splicer.tokens, chat=chat)


def _left(body: dict[str, Any], tokens: int, *, chat: bool) -> int | None:
    limit = body.get("max_completion_tokens") if chat else None
    limit = body.get("max_tokens") if limit is None else limit
    if limit is None and not chat:
        limit = 16  # vLLM's default for completions (vllm/entrypoints/openai/completion/protocol.py)
    if not isinstance(limit, int) or isinstance(limit, bool):
        return None
    return limit - tokens


def _single_prompt(body: dict[str, Any]) -> Any:
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        return prompt[0]  # a batch of one
    return prompt


def _prompt_ids(body: dict[str, Any], splicer: Splicer) -> list[int] | None:
    """Prompt + generated token ids up to where a continuation by ids starts, when both are known as ids."""
    if splicer.token_ids is None:
        return None
    generated = splicer.token_ids[: splicer.resume_ids]
    prompt = _single_prompt(body)
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        return [*prompt, *generated]
    if splicer.prompt_token_ids is not None:
        return [*splicer.prompt_token_ids, *generated]
    return None


def by_ids(body: dict[str, Any], splicer: Splicer, *, chat: bool) -> bool:
    """Whether the stream can continue by token ids (the prompt's and the generated ones are all known)."""
    if splicer.token_ids is None:
        return False
    return splicer.prompt_token_ids is not None if chat else _prompt_ids(body, splicer) is not None


def continuation(
    body: dict[str, Any],
    splicer: Splicer,
    *,
    chat: bool,
    path: str,
    context_len: int | None = None,
    parsers: ParserSettings = NO_PARSERS,
) -> Continuation:
    """The request that continues ``body`` (sent to ``path``) after what the client already received.

    By ids it starts at ``splicer.resume_ids`` (the splicer is then rewound there: ``Splicer.rewind``); by text,
    after all the text so far. A chat without a token limit runs to the end of the model's context: continued on
    /v1/completions (whose default is 16 tokens) it needs that length, ``context_len``; without it, it continues by
    text.
    """
    if not by_ids(body, splicer, chat=chat):
        return Continuation(path, _by_text(body, splicer, chat=chat), "text")
    resume = splicer.resume_ids
    if not chat:
        follow = _reduced(body, resume, chat=False) | {"prompt": _prompt_ids(body, splicer)}
        return Continuation(path, follow, "token_ids")
    left = _left(body, resume, chat=True)
    prompt = _prompt_ids(body, splicer)
    assert prompt is not None
    if left is None and context_len is not None:
        left = context_len - len(prompt)
    if left is None:
        return Continuation(path, _by_text(body, splicer, chat=True), "text")
    follow = _chat_by_ids(body, prompt, left=left, min_tokens=resume)
    if not skips_special_tokens(body, parsers):  # the chat's own text held them: the replay reads it
        follow["skip_special_tokens"] = False
    return Continuation(COMPLETIONS, follow, "token_ids")


def _chat_by_ids(body: dict[str, Any], prompt: list[int], *, left: int, min_tokens: int) -> dict[str, Any]:
    follow = {key: copy.deepcopy(value) for key, value in body.items() if key not in CHAT_ONLY}
    follow.update(prompt=prompt, max_tokens=max(1, left), stream=True)
    if body.get("logprobs") is True:  # the chat's bool and count are one count on /v1/completions
        top = body.get("top_logprobs")
        follow["logprobs"] = top if isinstance(top, int) and not isinstance(top, bool) else 0
    if isinstance(follow.get("min_tokens"), int):
        follow["min_tokens"] = max(0, follow["min_tokens"] - min_tokens)
    return follow


def _by_text(body: dict[str, Any], splicer: Splicer, *, chat: bool) -> dict[str, Any]:
    follow = _reduced(body, splicer.tokens, chat=chat)
    if chat:
        follow["messages"] = _messages(body, splicer.text_so_far)
        follow["continue_final_message"] = True
        follow["add_generation_prompt"] = False
    else:
        follow["prompt"] = _single_prompt(body) + splicer.text_so_far
    return follow


def _reduced(body: dict[str, Any], tokens: int, *, chat: bool) -> dict[str, Any]:
    """``body`` with its token bounds reduced by ``tokens`` generated."""
    follow = copy.deepcopy(body)
    left = _left(body, tokens, chat=chat)
    for name in ("max_tokens", "max_completion_tokens"):
        if name in follow and left is not None:
            follow[name] = left
    if not chat and "max_tokens" not in follow and left is not None:
        follow["max_tokens"] = left
    if isinstance(follow.get("min_tokens"), int):
        follow["min_tokens"] = max(0, follow["min_tokens"] - tokens)
    follow.pop("echo", None)  # the client already has the echo
    return follow


def _messages(body: dict[str, Any], text: str) -> list[Any]:
    messages = copy.deepcopy(list(body.get("messages") or []))
    last = messages[-1] if messages else None
    continuing = bool(body.get("continue_final_message")) and isinstance(last, dict) and last.get("role") == "assistant"
    if not continuing:
        return [*messages, {"role": "assistant", "content": text}]
    assert isinstance(last, dict)
    content = last.get("content")
    if isinstance(content, list):
        last["content"] = [*content, {"type": "text", "text": text}]
    else:
        last["content"] = (content or "") + text
    return messages
