"""The fake engine's thinking model: a chat's reply is reasoning, ``</think>``, an answer and, with tools, calls.

What it generates follows simulate/vllm/transcripts.py's thinking model, the one real vLLM 0.32 serves in the engine
tier: a ChatML template whose tool signatures sit in a system turn inside ``<tools></tools>``, and whose assistant
turn opens with ``<think>\\n`` (DeepSeek-R1's and Qwen3-thinking's templates do the same, which is why vLLM's
``deepseek_r1`` parser counts no reasoning tokens for it: the start marker is the prompt's). The model then writes
its reasoning, ``</think>``, ``\\n\\n`` and an answer, and where tools were offered one or two Hermes calls,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, then its end of turn ``<|im_end|>``.

Deterministic by context, as the plain tokens are: the whole reply is a function of the prompt's ids (the words by
``tokens.Context``, the lengths and calls by its hash), so a continuation sent as the prompt's ids and the ids
generated so far, on ``/v1/completions`` to another engine, yields exactly the rest. The reply starts after the
prompt's last ``<think>`` and its newline; the tools are read back from the prompt's ``<tools>`` bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from simulate.fakes.tokens import (
    BYTE_BASE,
    MARKER_IDS,
    WORD_PIECES,
    WORDS,
    ChatError,
    Context,
    byte_ids,
    message_text,
    token_id,
)

THINK_START = MARKER_IDS["<think>"]
THINK_END = MARKER_IDS["</think>"]
TOOL_START = MARKER_IDS["<tool_call>"]
TOOL_END = MARKER_IDS["</tool_call>"]
END_OF_TURN = MARKER_IDS["<|im_end|>"]  # the end-of-sequence token: generation stops on it, its text left out
_TOOLS = (MARKER_IDS["<tools>"], MARKER_IDS["</tools>"])
_NEWLINE = token_id("\n")  # how the template's own newlines tokenize (generated newlines are byte tokens)
ANSWER_WORDS = (6, 18)  # the answer's length in words, from the prompt's hash


@dataclass(frozen=True)
class Tool:
    """What the model reads of a tool's signature: its name and its parameters' names."""

    name: str
    parameters: tuple[str, ...]


@dataclass(frozen=True)
class Step:
    """One generated token and what it is: reasoning, think_end, content, call (a call's text, markers included,
    of call ``call``), between (the newline between two calls) or end (the end of turn)."""

    token: int
    kind: str
    call: int | None = None


def tools_of(body_tools: Any) -> list[Tool]:
    """The request's ``tools`` as the model reads them (functions with a name; others left out)."""
    out = []
    for tool in body_tools if isinstance(body_tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters") or {}
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            names = tuple(properties) if isinstance(properties, dict) else ()
            out.append(Tool(function["name"], tuple(str(n) for n in names)))
    return out


def render(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Tool] = (),
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The ChatML template of simulate/vllm/transcripts.py (``CHAT_TEMPLATE``): each tool one JSON line."""
    if continue_final_message and add_generation_prompt:
        raise ChatError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    if not messages:
        raise ChatError("messages must not be empty")
    parts = []
    if tools:
        lines = "".join("\n" + json.dumps({"name": t.name, "parameters": list(t.parameters)}) for t in tools)
        parts.append(f"<|im_start|>system\nYou may call functions.\n<tools>{lines}\n</tools><|im_end|>\n")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ChatError("every message needs a role")
        end = "" if index == len(messages) - 1 and continue_final_message else "<|im_end|>\n"
        parts.append(f"<|im_start|>{message['role']}\n{message_text(message)}{end}")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n<think>\n")
    return "".join(parts)


def reply_start(ids: Sequence[int]) -> int | None:
    """Where the reply starts in ``ids`` (after the last ``<think>`` and the template's newline); None: no reply
    was prompted (a plain prompt, which gets plain tokens)."""
    for at in range(len(ids) - 1, -1, -1):
        if ids[at] == THINK_START:
            return at + 2 if at + 1 < len(ids) and ids[at + 1] == _NEWLINE else at + 1
    return None


def read_tools(prompt_ids: Sequence[int]) -> list[Tool]:
    """The tools the prompt offers, read back from the bytes of its last ``<tools>`` block."""
    start, end = _TOOLS
    if start not in prompt_ids:
        return []
    at = len(prompt_ids) - 1 - list(reversed(prompt_ids)).index(start)
    block = []
    for token in prompt_ids[at + 1 :]:
        if token == end or not BYTE_BASE <= token < BYTE_BASE + 256:
            break
        block.append(token - BYTE_BASE)
    tools = []
    for line in bytes(block).decode(errors="replace").splitlines():
        try:
            signature = json.loads(line)
        except ValueError:
            continue
        if isinstance(signature, dict) and isinstance(signature.get("name"), str):
            tools.append(Tool(signature["name"], tuple(str(p) for p in signature.get("parameters") or ())))
    return tools


def _word(context: Context, *, whole: bool) -> int:
    token = context.next_token()
    return token % len(WORD_PIECES) if whole else token


def reply(prompt_ids: Sequence[int], *, reasoning_tokens: int, partial_utf8: bool) -> list[Step]:
    """The whole reply to a prompt that ends at its reply's start. The last word of the reasoning and of the answer
    is a whole one, so no character is split across a marker."""
    context = Context(prompt_ids, partial_utf8=partial_utf8)
    seed = context.state
    steps: list[Step] = []

    def add(token: int, kind: str, call: int | None = None) -> None:
        steps.append(Step(token, kind, call))
        context.push(token)

    for n in range(reasoning_tokens):
        add(_word(context, whole=n == reasoning_tokens - 1), "reasoning")
    add(THINK_END, "think_end")
    for token in byte_ids("\n\n"):
        add(token, "content")
    low, high = ANSWER_WORDS
    words = low + seed % (high - low + 1)
    for n in range(words):
        add(_word(context, whole=n == words - 1), "content")
    tools = read_tools(prompt_ids)
    calls = 1 + (seed >> 16) % 2 if tools else 0
    if calls:
        add(byte_ids("\n")[0], "content")
    for index in range(calls):
        if index:
            add(byte_ids("\n")[0], "between")
        for token in _call(tools[(seed >> (20 + index)) % len(tools)], seed >> (24 + 8 * index)):
            add(token, "call", index)
    add(END_OF_TURN, "end")
    return steps


def _call(tool: Tool, seed: int) -> list[int]:
    arguments = {name: WORDS[(seed >> (5 * n)) % len(WORDS)] for n, name in enumerate(tool.parameters[:2])}
    text = json.dumps({"name": tool.name, "arguments": arguments})
    return [TOOL_START, *byte_ids(f"\n{text}\n"), TOOL_END]


def continuation(ids: Sequence[int], *, reasoning_tokens: int, partial_utf8: bool) -> list[Step] | None:
    """What is left of the reply ``ids`` prompted and began (the prompt's ids and the ids generated so far); None
    where ``ids`` prompted none."""
    start = reply_start(ids)
    if start is None:
        return None
    steps = reply(ids[:start], reasoning_tokens=reasoning_tokens, partial_utf8=partial_utf8)
    return steps[len(ids) - start :]
