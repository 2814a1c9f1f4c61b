"""The chat deltas of a reasoning chat continued elsewhere, as vLLM 0.32's parsers would have sent them.

A chat served with ``--reasoning-parser`` (and ``--tool-call-parser``) streams the model's text split into
``reasoning``, ``content`` and ``tool_calls`` deltas. A continuation by token ids comes from ``/v1/completions``
as plain text, which no parser splits; ``ChatReplay`` splits it as vLLM's would. It mirrors
``vllm/parser/abstract_parser.py`` (``DelegatingParser.parse_delta``, one call per delta) with, for the reasoning,
``vllm/reasoning/deepseek_r1_reasoning_parser.py`` (on ``basic_parsers.BaseThinkingReasoningParser``) or
``vllm/parser/qwen3.py`` (a ``ParserEngine`` grammar, run through ``parser/engine/adapters.py``), and for tool calls
``gateway.tool_calls.Hermes``. These parsers keep state from every delta before (text and token ids), so the replay is
fed what was generated before the break first, its deltas dropped (the client has them), then the continuation's.

``deepseek_r1`` decides by token ids (``</think>`` ends the reasoning when its id is in a delta; the split inside
that delta is where ``</think>`` is in its text), ``qwen3`` by text (``</think>``, or a ``<tool_call>``, which
stays in the text the tool parser reads); both start in the reasoning unless the prompt closed it. The qwen3
engine holds back text that may begin a marker until it knows; so does the replay, chunks may split differently,
the message they add up to is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.tool_calls import TOOL_START, Delta, Hermes, tag_overlap, tool_call_id

REASONING_PARSERS = ("deepseek_r1", "qwen3")
TOOL_PARSERS = ("hermes",)
THINK_START = "<think>"
THINK_END = "</think>"
_QWEN3_ENDS = (THINK_END, TOOL_START)  # vllm/parser/qwen3.py: REASONING --THINK_END/TOOL_START--> out of it


@dataclass(frozen=True)
class Markers:
    """The reasoning markers' token ids in the model's vocabulary (vLLM's ``/tokenize`` gives them), and qwen3's
    turn boundaries (``<|im_start|>``, ``<|im_end|>``), where its look back through the prompt stops."""

    think_start: int
    think_end: int
    turn_boundaries: frozenset[int] = frozenset()


@dataclass(frozen=True)
class ChatParsers:
    """How the server parses chats (``--reasoning-parser``, ``--tool-call-parser``), and whether this request
    lets tools be called (``tool_choice`` other than ``none``; a request without tools has ``none``)."""

    reasoning: str | None = None
    tools: str | None = None
    markers: Markers | None = None
    tools_offered: bool = True

    def __post_init__(self) -> None:
        if self.reasoning not in (None, *REASONING_PARSERS) or self.tools not in (None, *TOOL_PARSERS):
            raise ValueError(f"no replay for parsers {self.reasoning!r}, {self.tools!r}")
        if self.reasoning is not None and self.markers is None:
            raise ValueError("a reasoning parser needs the markers' token ids")


@dataclass(frozen=True)
class Piece:
    """One delta of generated text and the token ids it decodes from, as vLLM's detokenizer gave them."""

    text: str
    ids: tuple[int, ...]


def message(
    *,
    content: str | None = None,
    reasoning: str | None = None,
    tool_calls: list[Delta] | None = None,
    keys: Sequence[str] = (),
) -> Delta:
    """A delta as vLLM's ``DeltaMessage`` serialises: the fields set (``keys``, even at ``None``) and those given."""
    values = {"content": content, "reasoning": reasoning, "tool_calls": tool_calls}
    return {k: v for k, v in values.items() if k in keys or v is not None}


def reasoning_open(parsers: ChatParsers, prompt_ids: Sequence[int]) -> bool:
    """Whether generation starts inside the reasoning: the prompt is looked back through for the last marker
    (``is_reasoning_end``: basic_parsers.py for deepseek_r1, parser/engine/parser_engine.py for qwen3)."""
    if parsers.reasoning is None or parsers.markers is None:
        return False
    markers = parsers.markers
    for token in reversed(prompt_ids):
        if token == markers.think_end:
            return False
        if token == markers.think_start or (parsers.reasoning == "qwen3" and token in markers.turn_boundaries):
            return True
    return True


@dataclass
class ChatReplay:
    """One chat stream's parsers, fed one delta at a time as vLLM feeds them."""

    parsers: ChatParsers
    prompt_ids: Sequence[int]
    new_id: Callable[[], str] = tool_call_id
    reasoning: bool = field(init=False)
    generated: list[int] = field(default_factory=list)  # StreamState.previous_token_ids, reasoning phase
    held: str = ""  # qwen3: text that may begin a marker
    tool_text: str | None = None  # the tool phase's text so far, once it began
    hermes: Hermes = field(init=False)
    tools_streamed: bool = False

    def __post_init__(self) -> None:
        self.reasoning = reasoning_open(self.parsers, self.prompt_ids)
        self.hermes = Hermes(new_id=self.new_id)

    def feed(self, piece: Piece, *, finished: bool = False) -> Delta | None:
        """The delta vLLM sends for ``piece``; None where it sends none (then only a chunk asked for token ids,
        or a finishing one, goes out, with ``{}``)."""
        out: Delta | None
        text = piece.text
        ended_here = False
        if self.reasoning:
            out, rest = self._reasoning(piece)
            self.generated += piece.ids
            if rest is not None:
                self.reasoning, ended_here = False, True
                text = rest
        else:
            out = None
        if not self.reasoning and self.parsers.tools is not None:
            out = self._tool_phase(text, out) if self.parsers.tools_offered else self._no_tools(text, out)
        elif not self.reasoning and not ended_here:  # no phase: the text as it came, even empty
            out = message(content=text, keys=("content",))
        if finished:
            out = self._finish(out)
        return out

    def _reasoning(self, piece: Piece) -> tuple[Delta | None, str | None]:
        """The reasoning phase's delta, and the text after the reasoning's end when it ends in this piece."""
        if self.parsers.reasoning == "qwen3":
            return self._qwen3(piece.text)
        return self._deepseek_r1(piece)

    def _deepseek_r1(self, piece: Piece) -> tuple[Delta | None, str | None]:
        # DeepSeekR1ReasoningParser.extract_reasoning_streaming over BaseThinkingReasoningParser's, then
        # DelegatingParser's switch when is_reasoning_end_streaming (the end id in this delta).
        assert self.parsers.markers is not None
        start, end = self.parsers.markers.think_start, self.parsers.markers.think_end
        ids, text = piece.ids, piece.text
        ends = end in ids
        if len(ids) == 1 and ids[0] in (start, end):
            return None, ("" if ends else None)
        if start not in self.generated and start in ids:
            opened = text.find(THINK_START) + len(THINK_START)
            if not ends:
                return message(reasoning=text, keys=("reasoning",)), None
            at = text.find(THINK_END)  # vLLM uses find's -1 as an index too when the text lacks it
            after = text[at + len(THINK_END) :]
            delta = message(reasoning=text[opened:at], content=after or None, keys=("reasoning", "content"))
            return delta, after
        if ends:
            at = text.find(THINK_END)
            after = text[at + len(THINK_END) :]
            return message(reasoning=text[:at], content=after or None, keys=("reasoning", "content")), after
        return message(reasoning=text, keys=("reasoning",)), None

    def _qwen3(self, text: str) -> tuple[Delta | None, str | None]:
        # Qwen3Parser's grammar in the REASONING state: <think> is dropped, </think> leaves it (dropped too),
        # <tool_call> leaves it and stays as content for the tool parser; the lexer waits on a marker's prefix.
        text = self.held + text
        self.held = ""
        ends = [(at, marker) for marker in _QWEN3_ENDS if (at := text.find(marker)) != -1]
        if ends:
            at, marker = min(ends)
            reasoning = text[:at].replace(THINK_START, "")
            after = text[at + len(THINK_END) :] if marker == THINK_END else text[at:]
            return message(reasoning=reasoning or None, content=after or None), after
        hold = max(tag_overlap(text, marker) for marker in (*_QWEN3_ENDS, THINK_START))
        self.held = text[len(text) - hold :] if hold else ""
        reasoning = text[: len(text) - hold].replace(THINK_START, "")
        return (message(reasoning=reasoning) if reasoning else None), None

    def _tool_phase(self, text: str, before: Delta | None) -> Delta | None:
        self.tool_text = text if self.tool_text is None else self.tool_text + text
        out = self.hermes.feed(self.tool_text)
        reasoning = before.get("reasoning") if before else None
        if reasoning:
            out = message(reasoning=reasoning) if out is None else {**out, "reasoning": reasoning}
        if out and out.get("tool_calls"):
            self.tools_streamed = True
        return out

    def _no_tools(self, text: str, before: Delta | None) -> Delta | None:
        # tool_choice "none": DelegatingParser._extract_tool_calls_streaming passes non-empty text as content.
        reasoning = before.get("reasoning") if before else None
        return message(content=text or None, reasoning=reasoning) or None

    def _finish(self, out: Delta | None) -> Delta | None:
        # finalize_generation: the last call's unstreamed arguments; _flush_engine_parsers: qwen3's held text.
        if out and out.get("tool_calls"):
            last = out["tool_calls"][-1]
            function = last.get("function") or {}
            remaining = self.hermes.unstreamed()
            last["function"] = {**function, "arguments": (function.get("arguments") or "") + remaining}
        if self.reasoning and self.held:
            out = dict(out or {})
            out["reasoning"] = (out.get("reasoning") or "") + self.held
            self.held = ""
        return out


def finish_reason(reason: str | None, *, tools_streamed: bool, named_tool: bool = False) -> str:
    """The chat's finish reason from the completion's: ``tool_calls`` once a tool call was streamed and it stopped
    (vllm/entrypoints/openai/chat_completion/serving.py, chat_completion_stream_generator)."""
    if tools_streamed and not named_tool and reason == "stop":
        return "tool_calls"
    return reason or "stop"


def reasoning_tokens(parsers: ChatParsers, generated_ids: Sequence[int]) -> int:
    """``usage.completion_tokens_details.reasoning_tokens``: deepseek_r1 counts the tokens between markers it saw
    generated (``count_reasoning_tokens``; none where ``<think>`` was in the prompt); qwen3, those before the end."""
    if parsers.markers is None or parsers.reasoning is None:
        return 0
    start, end = parsers.markers.think_start, parsers.markers.think_end
    if parsers.reasoning == "qwen3":
        return next((i for i, token in enumerate(generated_ids) if token == end), len(generated_ids))
    count = depth = 0
    for token in generated_ids:
        if token == start:
            depth += 1
        elif token == end:
            depth = max(0, depth - 1)
        elif depth:
            count += 1
    return count


def continued(
    parsers: ChatParsers,
    prompt_ids: Sequence[int],
    before: Sequence[Piece],
    after: Sequence[Piece],
    *,
    new_id: Callable[[], str] = tool_call_id,
) -> tuple[list[Delta | None], bool]:
    """The deltas vLLM would have sent for ``after`` (the continuation's pieces, the last one finishing the stream)
    following ``before`` (what it generated before the break), and whether a tool call was streamed in all."""
    replay = ChatReplay(parsers, prompt_ids, new_id=new_id)
    for piece in before:
        replay.feed(piece)
    deltas = [replay.feed(piece, finished=i == len(after) - 1) for i, piece in enumerate(after)]
    return deltas, replay.tools_streamed


def assembled(deltas: Sequence[Delta | None]) -> Delta:
    """The message a client builds from a stream's deltas: texts joined, tool calls gathered by ``index`` (the
    first delta of a call names it, the others carry its index and more of its arguments)."""
    out: Delta = {"content": None, "reasoning": None, "tool_calls": []}
    calls: dict[int, Delta] = {}
    for delta in deltas:
        for key in ("content", "reasoning"):
            if (delta or {}).get(key):
                out[key] = (out[key] or "") + delta[key]  # type: ignore[index]
        for call in (delta or {}).get("tool_calls") or ():
            into = calls.setdefault(call["index"], {"index": call["index"], "id": None, "name": None, "arguments": ""})
            function = call.get("function") or {}
            into["id"] = call.get("id") or into["id"]
            into["name"] = function.get("name") or into["name"]
            into["arguments"] += function.get("arguments") or ""
    out["tool_calls"] = [calls[index] for index in sorted(calls)]
    return out
