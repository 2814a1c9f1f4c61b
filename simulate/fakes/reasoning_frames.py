"""The chat deltas vLLM 0.32 streams for the thinking model's reply when it is served with its parsers.

``--reasoning-parser deepseek_r1|qwen3`` and ``--enable-auto-tool-choice --tool-call-parser hermes`` split the
reply's text into ``reasoning``, ``content`` and ``tool_calls`` deltas, one engine step at a time
(vllm/parser/abstract_parser.py ``DelegatingParser.parse_delta``), and the chat server writes each as a chunk
(vllm/entrypoints/openai/chat_completion/serving.py ``chat_completion_stream_generator``). What this models, as
tests/engines/test_reasoning_frames.py measured it on real vLLM:

- reasoning comes as ``{"reasoning": text}``; deepseek_r1 (vllm/reasoning/basic_parsers.py
  ``extract_reasoning_streaming``) sends it for every token, an empty text too; qwen3 (vllm/parser/qwen3.py, a
  grammar over text) sends nothing for a token without text;
- the ``</think>`` token has no delta: its chunk goes out as ``delta: {}`` only where the client asked for token
  ids (a delta of None is skipped otherwise; qwen3 without a tool parser returns an empty delta, always sent);
- after it, with tools offered, Hermes (vllm/tool_parsers/hermes_tool_parser.py ``extract_tool_calls_streaming``)
  re-reads the text since the reasoning at every step: content before the first ``<tool_call>`` (less any start of
  that marker), a call named once its name's closing quote came (``{"content": null, "tool_calls": [{id, type,
  index, function: {name}}]}``), then its arguments' new text each step (``[{index, function: {arguments}}]``),
  the whole call's closing brace never; without tools offered the text is content as it comes (``tool_choice``
  ``none``: only text that is not empty); without a tool parser, content even when empty;
- ``include_reasoning: false`` drops the reasoning, the deltas that had only that, and every chunk's ids;
- the finish is ``tool_calls`` once a call was streamed and the model stopped, and the usage counts
  ``completion_tokens_details.reasoning_tokens`` as the reasoning parser does (deepseek_r1: tokens between a
  ``<think>`` and a ``</think>`` both generated, none here; qwen3: tokens before the ``</think>``).

Not streamed, the chat's message is what ``DelegatingParser.parse`` makes of the whole text (``whole``). One engine
step a chunk: the deltas of steps merged into one chunk, as a loaded vLLM sends them, are not modelled here.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from simulate.fakes.openai_format import Output, Stream
from simulate.fakes.thinking import THINK_END, THINK_START

Delta = dict[str, Any]
TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')  # Hermes2ProToolParser._extract_tool_name
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')  # Hermes2ProToolParser._extract_tool_args


@dataclass(frozen=True)
class Parsers:
    """The engine's parsers, and what the request makes of them."""

    reasoning: str | None
    tools: str | None
    tools_offered: bool
    include_reasoning: bool = True


def _overlap(text: str, tag: str) -> int:
    """How much of ``tag``'s start ends ``text`` (vllm/tool_parsers/utils.py ``partial_tag_overlap``)."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)


def _whole(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class _Calls:
    """Hermes' state: what it sent of the content and of each call."""

    sent_content: int = 0
    named: list[bool] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)

    def feed(self, text: str) -> Delta | None:
        at = text.find(TOOL_START)
        sendable = at if at != -1 else len(text) - _overlap(text, TOOL_START)
        content = text[self.sent_content : sendable] if sendable > self.sent_content else None
        self.sent_content = max(self.sent_content, sendable)
        calls: list[Delta] = []
        for index, (body, whole) in enumerate(_regions(text)):
            if index == len(self.named):
                self.named.append(False)
                self.streamed.append("")
            if not self.named[index]:
                name = _NAME.search(body)
                if name is None:
                    break
                self.named[index] = True
                function = {"name": name.group(1)}
                calls.append({"id": f"chatcmpl-tool-{secrets.token_hex(8)}", "type": "function", "index": index})
                calls[-1]["function"] = function
            arguments = _arguments(body, whole)
            if arguments is not None and len(arguments) > len(self.streamed[index]):
                calls.append({"index": index, "function": {"arguments": arguments[len(self.streamed[index]) :]}})
                self.streamed[index] = arguments
        if not content and not calls:
            return None
        return {"content": content, "tool_calls": calls} if calls else {"content": content}


def _regions(text: str) -> list[tuple[str, bool]]:
    """Each ``<tool_call>`` region's JSON so far and whether it is whole (``_extract_tool_call_jsons``)."""
    out = []
    at = 0
    while (start := text.find(TOOL_START, at)) != -1:
        end = text.find(TOOL_END, start)
        if end != -1:
            out.append((text[start + len(TOOL_START) : end].strip(), True))
            at = end + len(TOOL_END)
            continue
        raw = text[start + len(TOOL_START) :]
        raw = raw[: len(raw) - _overlap(raw, TOOL_END)].strip()
        out.append((raw, bool(raw) and _whole(raw)))
        break
    return out


def _arguments(body: str, whole: bool) -> str | None:
    match = _ARGUMENTS.search(body)
    if match is None:
        return None
    raw = body[match.end() :]
    if whole:
        raw = raw.rstrip()
        raw = raw[:-1].rstrip() if raw.endswith("}") else raw
    return raw


@dataclass
class ChatFrames:
    """One choice's deltas, fed a step at a time: its token and the text the detokenizer gave it."""

    parsers: Parsers
    with_ids: bool = False  # the client asked for token ids (return_token_ids)
    reasoning: bool = field(init=False)
    tool_text: str = ""
    calls: _Calls = field(default_factory=_Calls)
    generated: list[int] = field(default_factory=list)
    tools_streamed: bool = False

    def __post_init__(self) -> None:
        # The template opens the reasoning (<think> ends the prompt): every parser starts inside it.
        self.reasoning = self.parsers.reasoning is not None

    def delta(self, token: int, text: str, *, finished: bool) -> Delta | None:
        """The delta vLLM sends for this step; None where it sends none."""
        self.generated.append(token)
        if self.reasoning:
            out = self._reasoning(token, text)
        elif self.parsers.tools is not None and self.parsers.tools_offered:
            self.tool_text += text
            out = self.calls.feed(self.tool_text)
            self.tools_streamed |= bool(out and out.get("tool_calls"))
        elif self.parsers.tools is not None:
            out = {"content": text} if text else None
        else:
            out = {"content": text}
        if finished and out and out.get("tool_calls") and not self.calls.streamed[-1]:
            out["tool_calls"][-1].setdefault("function", {})["arguments"] = "{}"  # finalize_generation
        if out is not None and not self.parsers.include_reasoning:
            out = _without_reasoning(out)
        return out

    def _reasoning(self, token: int, text: str) -> Delta | None:
        if token == THINK_END:
            self.reasoning = False
            return {} if self.parsers.reasoning == "qwen3" and self.parsers.tools is None else None
        if self.parsers.reasoning == "qwen3" and not text:
            return None
        return {"reasoning": text}

    def chunk(
        self, out: Stream, token: int, text: str, *, finish: str | None, stop: str | None, index: int
    ) -> bytes | None:
        """The step's chunk; None where vLLM sends none (no delta, not the last, no ids asked)."""
        delta = self.delta(token, text, finished=finish is not None)
        with_ids = self.with_ids and self.parsers.include_reasoning  # hidden reasoning hides every chunk's ids
        if delta is None and finish is None and not with_ids:
            return None
        shown = out if with_ids else replace(out, token_ids=False)
        reason = None if finish is None else self.finish_reason(finish)
        return shown.token(text, [token], finish=reason, stop=stop, prompt_ids=None, index=index, delta=delta or {})

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.tools_streamed and reason == "stop" else reason

    def reasoning_tokens(self) -> int:
        return reasoning_tokens(self.parsers, self.generated)


def reasoning_tokens(parsers: Parsers, generated: Sequence[int]) -> int:
    """``count_reasoning_tokens``: qwen3's, those before the end; deepseek_r1's, those between generated markers
    (vllm/reasoning/basic_parsers.py)."""
    if parsers.reasoning == "qwen3":
        return generated.index(THINK_END) if THINK_END in generated else len(generated)
    count = depth = 0
    for token in generated:
        if token in (THINK_START, THINK_END):
            depth = depth + 1 if token == THINK_START else max(0, depth - 1)
        elif depth:
            count += 1
    return count


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # Hermes2ProToolParser's


def whole(parsers: Parsers, text: str) -> dict[str, Any]:
    """A whole (not streamed) chat's message fields, as ``DelegatingParser.parse`` splits its text: the reasoning
    up to ``</think>`` (all of it without one; ``BaseThinkingReasoningParser.extract_reasoning``), content after it
    (None if empty), and with tools offered Hermes' calls (``extract_tool_calls``), the content then what precedes
    the first one, None where that is only white space (``_extract_tool_calls``)."""
    reasoning, content, calls = None, text or None, []
    if parsers.reasoning is not None:
        before, opened, after = text.partition("<think>")
        text = after if opened else before
        reasoning, ended, rest = text.partition("</think>")
        content = (rest or None) if ended else None
    if parsers.tools is not None and parsers.tools_offered and content and TOOL_START in content:
        try:
            found = [json.loads(a or b) for a, b in _CALL.findall(content)]
            calls = [_call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in found]
        except (ValueError, KeyError, TypeError):
            calls = []  # vLLM logs it and gives the text as it is
        if calls:
            content = content[: content.find(TOOL_START)] or None
            content = None if content is not None and not content.strip() else content
    hidden = not parsers.include_reasoning
    return {"content": content, "reasoning": None if hidden else reasoning, "tool_calls": calls, "hidden": hidden}


def _call(name: str, arguments: str) -> Delta:
    function = {"name": name, "arguments": arguments}
    return {"id": f"chatcmpl-tool-{secrets.token_hex(8)}", "type": "function", "function": function}


def parsed(parsers: Parsers, output: Output) -> Output:
    """A whole chat's output with the parsers' message, and its reasoning tokens where a reasoning parser counts."""
    counted = reasoning_tokens(parsers, output.ids) if parsers.reasoning is not None else None
    return replace(output, parsed=whole(parsers, output.text), reasoning_tokens=counted)


def _without_reasoning(delta: Delta) -> Delta | None:
    # parse_delta sets reasoning to None on the delta (so it is written, as null) and drops one left empty.
    if not delta.get("content") and not delta.get("tool_calls"):
        return None
    out = {"content": delta["content"]} if "content" in delta else {}
    out["reasoning"] = None
    return out | ({"tool_calls": delta["tool_calls"]} if "tool_calls" in delta else {})
