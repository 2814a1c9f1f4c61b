"""A chat the engine parses (reasoning, tool calls), continued on ``/v1/completions``: pure, no I/O.

vLLM 0.32 served with ``--reasoning-parser`` or ``--enable-auto-tool-choice --tool-call-parser`` splits a chat's text
into ``reasoning``, ``content`` and ``tool_calls`` deltas. A continuation by token ids comes back as plain text; the
gateway replays the parsers over it (gateway.reasoning, gateway.tool_calls), fed first what was generated before the
break as one piece: vLLM's ``/detokenize`` of those ids (gateway.vocabulary). It pays for that only when a stream
breaks: until then the chunks go through as they came.

Each continuation chunk keeps its place, ids and finish, and gets the delta vLLM would have sent for its text; one
that would have had no delta (the ``</think>`` token, a call's name being written) is sent as ``{}`` only where the
client asked for token ids, as vLLM does. The finish is the chat's (``tool_calls`` once a call was streamed), and the
usage counts the reasoning tokens as the parser does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.reasoning import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    ChatParsers,
    ChatReplay,
    Markers,
    Piece,
    finish_reason,
    reasoning_tokens,
)
from gateway.settings import ParserSettings

# What vLLM's /tokenize is asked, to learn the markers' ids, and for qwen3 its turn boundaries (Qwen's ChatML; a
# vocabulary without them as tokens, DeepSeek-R1's, needs none: only qwen3 looks back for them).
THINK_TEXT = "<think></think>"
TURNS_TEXT = "<|im_start|><|im_end|>"


def supported(parsers: ParserSettings) -> bool:
    """Whether the gateway replays every parser the backends use (and the backends use one)."""
    if parsers.reasoning is None and parsers.tools is None:
        return False
    return parsers.reasoning in (None, *REASONING_PARSERS) and parsers.tools in (None, *TOOL_PARSERS)


def tools_offered(body: dict[str, Any]) -> bool:
    """Whether the request lets the model call a tool (vLLM: tools given and ``tool_choice`` not ``none``)."""
    return bool(body.get("tools")) and body.get("tool_choice", "auto") != "none"


def skips_special_tokens(body: dict[str, Any], parsers: ParserSettings) -> bool:
    """The chat's ``skip_special_tokens`` once its parsers adjusted it: qwen3's and hermes' (with tools offered)
    ``adjust_request`` set it false, so that their markers stay in the text (vllm/parser/qwen3.py,
    vllm/tool_parsers/hermes_tool_parser.py)."""
    if parsers.reasoning == "qwen3" or (parsers.tools == "hermes" and tools_offered(body)):
        return False
    return body.get("skip_special_tokens", True) is not False


def parser_refusal(body: dict[str, Any], parsers: ParserSettings, *, reasoning: bool, tools: bool) -> str | None:
    """Why a chat so far (``reasoning``, ``tools``: the engine sent such deltas) cannot continue for its parsers;
    None: it can (where the parsers are known, through ``Replayed``)."""
    if parsers.reasoning is not None and body.get("include_reasoning") is False:
        return "reasoning_hidden"  # vLLM then sends the reasoning's tokens without their ids: nothing to resume from
    unknown_tools = parsers.tools is not None and parsers.tools not in TOOL_PARSERS
    if (tools or (unknown_tools and tools_offered(body))) and not (
        parsers.tools in TOOL_PARSERS and supported(parsers)
    ):
        return "tool_call"  # a call may come next: with an unknown parser it would reach the client as text
    if reasoning and (parsers.reasoning not in REASONING_PARSERS or not supported(parsers)):
        return "reasoning"
    return None


def chat_parsers(body: dict[str, Any], parsers: ParserSettings, markers: Markers | None) -> ChatParsers:
    """The replay's parsers for this request (``markers``: from /tokenize, ``markers_from``)."""
    return ChatParsers(parsers.reasoning, parsers.tools, markers, tools_offered=tools_offered(body))


def markers_from(think: Sequence[int], turns: Sequence[int] = ()) -> Markers | None:
    """``Markers`` from /tokenize's ids for ``THINK_TEXT`` and ``TURNS_TEXT``; None where the vocabulary lacks a
    ``<think>`` or ``</think>`` token (its parser could not work either), no boundaries where it lacks those."""
    if len(think) != 2:
        return None
    return Markers(think[0], think[1], frozenset(turns) if len(turns) == 2 else frozenset())


@dataclass
class Replayed:
    """A continuation's chunks turned into the chat's: built on what the stream generated before (``before``)."""

    replay: ChatReplay
    generated: list[int] = field(default_factory=list)  # every id of the stream so far, for the usage
    named_tool: bool = False

    @classmethod
    def after(
        cls, parsers: ChatParsers, prompt_ids: Sequence[int], before: Piece, *, named_tool: bool = False
    ) -> Replayed:
        replay = ChatReplay(parsers, prompt_ids)
        if before.ids:
            replay.feed(before)
        return cls(replay, list(before.ids), named_tool)

    def chunk(self, choice: dict[str, Any], *, repeated: int, with_ids: bool) -> bool:
        """Give ``choice`` (a chat choice made of a completions one, gateway.reshape) the delta and finish vLLM's
        parsers would have; whether it goes to the client. Its first ``repeated`` tokens the client had already
        (generated again after a rewind): they were the start of a character, with no text, so the parsers are fed
        them and the client gets only the rest."""
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else None
        ids = choice.get("token_ids")
        ids = [i for i in ids if isinstance(i, int)] if isinstance(ids, list) else []
        finish = choice.get("finish_reason")
        self.generated += ids
        out = self.replay.feed(Piece(text if isinstance(text, str) else "", tuple(ids)), finished=finish is not None)
        choice["delta"] = out or {}
        if finish is not None:
            tools = self.replay.tools_streamed
            choice["finish_reason"] = finish_reason(finish, tools_streamed=tools, named_tool=self.named_tool)
            return True
        if repeated:
            choice["token_ids"] = ids[repeated:]
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
                logprobs["content"] = logprobs["content"][repeated:]
            if not choice["token_ids"]:
                return False
        # vLLM sends a chunk without a delta (the </think> token, a call's name being written) only with its ids.
        return out is not None or (with_ids and bool(ids))

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """``usage`` with the reasoning tokens of the whole stream, as the chat counts them."""
        tokens = reasoning_tokens(self.replay.parsers, self.generated)
        return {**usage, "completion_tokens_details": {"reasoning_tokens": tokens}}
