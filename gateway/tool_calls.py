"""The tool-call deltas of a chat continued elsewhere, as vLLM 0.32's ``hermes`` parser would have sent them.

A chat served with ``--enable-auto-tool-choice --tool-call-parser hermes`` streams a call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the model's text, which the client never sees:
it gets ``tool_calls`` deltas instead. When the stream breaks, the rest comes from ``/v1/completions`` as plain text;
``Hermes`` turns that text back into the deltas vLLM would have sent, by the rules of
``vllm/tool_parsers/hermes_tool_parser.py`` (``Hermes2ProToolParser.extract_tool_calls_streaming``): it re-reads the
whole tool-phase text at each delta and sends what was not sent yet. Replayed over the text generated before the
break first, it knows what the client already has: a call whose name was sent keeps its index and its id (later
deltas carry only the index), and only the arguments' rest follows.

Pure: no I/O; a ``Delta`` is the JSON object vLLM writes as a chunk's ``choices[0].delta``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
# Hermes2ProToolParser._extract_tool_name and _extract_tool_args.
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')

Delta = dict[str, Any]


def tool_call_id() -> str:
    """A new call's id as vLLM makes it by default (vllm/renderers/chat_utils.py ``make_tool_call_id``, random)."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


def tag_overlap(text: str, tag: str) -> int:
    """How much of ``tag``'s start ends ``text`` (vllm/tool_parsers/utils.py ``partial_tag_overlap``)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def call_jsons(text: str) -> list[tuple[str, bool]]:
    """Each ``<tool_call>`` region's JSON text and whether it is whole (``_extract_tool_call_jsons``)."""
    found: list[tuple[str, bool]] = []
    at = 0
    while (start := text.find(TOOL_START, at)) != -1:
        body = start + len(TOOL_START)
        end = text.find(TOOL_END, body)
        if end != -1:
            found.append((text[body:end].strip(), True))
            at = end + len(TOOL_END)
            continue
        raw = text[body:]
        if overlap := tag_overlap(raw, TOOL_END):
            raw = raw[:-overlap]
        whole = raw.strip()
        found.append((whole, _complete_json(whole) if whole else False))
        break
    return found


def call_arguments(body: str, whole: bool) -> str | None:
    """The arguments' text so far; a whole call's without the brace that closes the call (``_extract_tool_args``)."""
    match = _ARGUMENTS.search(body)
    if match is None:
        return None
    raw = body[match.end() :]
    if whole:
        raw = raw.rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
    return raw


@dataclass
class Hermes:
    """One stream's tool phase, fed the whole text after the reasoning at each delta, as vLLM feeds its parser.

    ``new_id`` names a call whose name is sent here; one begun before the break was named already.
    """

    new_id: Callable[[], str] = tool_call_id
    sent_content: int = 0  # Hermes2ProToolParser._sent_content_idx
    names: list[str | None] = field(default_factory=list)  # prev_tool_call_arr[i]["name"]
    arguments: list[str | None] = field(default_factory=list)  # prev_tool_call_arr[i]["arguments"]
    streamed: list[str] = field(default_factory=list)  # streamed_args_for_tool

    @property
    def called(self) -> bool:
        return any(name is not None for name in self.names)

    def feed(self, text: str) -> Delta | None:
        """The delta vLLM sends once the tool phase's text is ``text``; None where it sends none."""
        content = self._content(text)
        calls: list[Delta] = []
        for index, (body, whole) in enumerate(call_jsons(text)):
            if index >= len(self.names):
                self.names.append(None)
                self.arguments.append(None)
                self.streamed.append("")
            if self.names[index] is None:
                match = _NAME.search(body)
                if match is None:
                    break  # a later call cannot start before this one has its name
                self.names[index] = match.group(1)
                function = {"name": match.group(1)}
                calls.append({"id": self.new_id(), "type": "function", "index": index, "function": function})
            diff = self._arguments_diff(index, body, whole)
            if diff:
                calls.append({"index": index, "function": {"arguments": diff}})
        if not content and not calls:
            return None
        return {"content": content, "tool_calls": calls} if calls else {"content": content}

    def unstreamed(self) -> str:
        """What the last call's arguments still lack at the end (ToolParser.get_remaining_unstreamed_args)."""
        if not self.names:
            return ""
        arguments = self.arguments[-1]
        expected = "{}" if arguments is None else arguments
        return expected[len(self.streamed[-1]) :] if expected.startswith(self.streamed[-1]) else ""

    def _content(self, text: str) -> str | None:
        # Text that could still become "<tool_call>" is held back.
        sendable = text.index(TOOL_START) if TOOL_START in text else len(text) - tag_overlap(text, TOOL_START)
        if sendable <= self.sent_content:
            return None
        content = text[self.sent_content : sendable]
        self.sent_content = sendable
        return content

    def _arguments_diff(self, index: int, body: str, whole: bool) -> str | None:
        arguments = call_arguments(body, whole)
        if arguments is None or len(arguments) <= len(self.streamed[index]):
            return None
        diff = arguments[len(self.streamed[index]) :]
        self.streamed[index] = arguments
        self.arguments[index] = arguments
        return diff
