"""The reasoning-streams scenario's chats: what the load asks, and the message each must assemble to.

The fake engines run as a thinking model served with vLLM's parsers (``--reasoning-parser deepseek_r1
--enable-auto-tool-choice --tool-call-parser hermes``: simulate/fakes/thinking.py and reasoning_frames.py), reasoning
for longer than the notice. Every other slot offers tools, so those chats end in one or two calls. A client judges a
stream as its user would: by the message it assembles (reasoning, content, each call's name and arguments, the finish
reason), which must be the one the uninterrupted stream gives. The fake is deterministic by context, so that message
is known without asking: the engine's own model, run here without its pacing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from simulate.fakes.openai_format import ChatParsers, read_job
from simulate.fakes.reasoning_frames import ChatFrames, Parsers
from simulate.fakes.thinking import END_OF_TURN, continuation
from simulate.fakes.tokens import Detokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
        },
    },
]
REASONING_PARSER = "deepseek_r1"
TOOL_PARSER = "hermes"
REASONING_PER_NOTICE = 1.2  # a chat's reasoning lasts this many notices
TAIL_TOKENS = 400  # room past the reasoning for the answer and the calls: a long chat ends with its end of turn


@dataclass(frozen=True)
class Message:
    """What a client assembles from a chat stream (calls by index: their name and arguments; ids are random)."""

    reasoning: str = ""
    content: str = ""
    calls: tuple[tuple[str, str], ...] = ()
    finish_reason: str | None = None
    roles: int = 0


@dataclass
class Assembly:
    """A chat stream's chunks as they come, assembled as a client of the OpenAI API does."""

    tokens: int = 0
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    names: dict[int, list[str]] = field(default_factory=dict)  # every name each call was given
    arguments: dict[int, list[str]] = field(default_factory=dict)
    finish_reason: str | None = None
    roles: int = 0

    def feed(self, chunk: Any) -> None:
        for choice in chunk.get("choices") or () if isinstance(chunk, dict) else ():
            ids = choice.get("token_ids")
            self.tokens += len(ids) if isinstance(ids, list) else 0
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            delta = choice.get("delta") or {}
            self.roles += "role" in delta
            self.reasoning.append(delta.get("reasoning") or "")
            self.content.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                if "name" in function:
                    self.names.setdefault(call["index"], []).append(function["name"])
                self.arguments.setdefault(call["index"], []).append(function.get("arguments") or "")

    def message(self) -> Message:
        calls = tuple(
            ("|".join(self.names.get(i, [])), "".join(self.arguments.get(i, []))) for i in sorted(self.arguments)
        )
        return Message("".join(self.reasoning), "".join(self.content), calls, self.finish_reason, self.roles)


@dataclass(frozen=True)
class Chats:
    """The chats of a run whose engines reason for ``reasoning_tokens`` tokens."""

    reasoning_tokens: int

    @classmethod
    def lasting(cls, notice_s: float, tokens_per_s: float) -> Chats:
        return cls(max(1, round(REASONING_PER_NOTICE * notice_s * tokens_per_s)))

    def engine_flags(self) -> tuple[str, ...]:
        return (
            *("--reasoning-parser", REASONING_PARSER, "--enable-auto-tool-choice", "--tool-call-parser", TOOL_PARSER),
            *("--reasoning-tokens", str(self.reasoning_tokens)),
        )

    @staticmethod
    def gateway_flags() -> tuple[str, ...]:
        return ("--reasoning-parser", REASONING_PARSER, "--tool-call-parser", TOOL_PARSER)

    def max_tokens(self, wanted: int) -> int:
        """A short chat ends by its length, in its reasoning; a long one reasons, answers and calls to its end."""
        return wanted if wanted < self.reasoning_tokens else self.reasoning_tokens + TAIL_TOKENS

    def body(self, *, slot: int, name: str, max_tokens: int) -> dict[str, object]:
        body: dict[str, object] = {
            "messages": [{"role": "user", "content": f"slot {slot} asks question {name}"}],
            "max_tokens": max_tokens,
            "stream": True,
            "return_token_ids": True,
        }
        return body | {"tools": TOOLS} if slot % 2 else body

    def expected(self, body: dict[str, object]) -> Message:
        """The message of ``body``'s uninterrupted stream, as the engine generates and its parsers split it."""
        job = read_job(body, chat=True, max_model_len=1 << 20, parsers=ChatParsers(REASONING_PARSER, TOOL_PARSER))
        steps = continuation(job.prompt_ids, reasoning_tokens=self.reasoning_tokens, partial_utf8=True) or []
        detokenizer = Detokenizer(job.prompt_ids, skip_special=job.skip_special_tokens)
        frames = ChatFrames(Parsers(REASONING_PARSER, TOOL_PARSER, job.tools, job.include_reasoning))
        assembly = Assembly(roles=1)
        tokens = [s.token for s in steps[: job.max_tokens]]
        for n, token in enumerate(tokens):
            end = token == END_OF_TURN
            finish = "stop" if end else "length" if n == len(tokens) - 1 else None
            text = "" if end else detokenizer.step(token)
            delta = frames.delta(token, text, finished=finish is not None)
            reason = None if finish is None else frames.finish_reason(finish)
            assembly.feed({"choices": [{"delta": delta or {}, "finish_reason": reason, "token_ids": [token]}]})
        return assembly.message()


def assemble(lines: Iterable[bytes]) -> Assembly:
    """A stream's ``data:`` lines, assembled (lines that are not JSON chunks left out)."""
    assembly = Assembly()
    for raw in lines:
        line = raw.decode(errors="replace").strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            try:
                assembly.feed(json.loads(line.removeprefix("data: ")))
            except ValueError:
                continue
    return assembly


def differences(got: Message, want: Message) -> Sequence[str]:
    """Which parts of the message differ, for the log."""
    parts = ("reasoning", "content", "calls", "finish_reason", "roles")
    return [name for name in parts if getattr(got, name) != getattr(want, name)]
