"""What a client of the ``openai`` package makes of a chat stream: the message it assembles, and where calls are named.

Shared by the tests that judge reasoning and tool-call streams continued by the gateway, against fake engines and
real vLLM alike: two streams are the same chat when they assemble to the same message.
"""

from __future__ import annotations

from typing import Any

from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from simulate.fakes.sse_client import Streamed


def message(streamed: Streamed) -> dict[str, Any]:
    """The message, finish reason and usage a client of the ``openai`` package assembles from the stream."""
    state = ChatCompletionStreamState()
    for chunk in streamed.chunks:
        if "error" not in chunk:
            state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    snapshot = state.current_completion_snapshot
    choice = snapshot.choices[0]
    usage = snapshot.usage.model_dump(exclude_none=True) if snapshot.usage else None
    return {**choice.message.model_dump(exclude_none=True), "finish_reason": choice.finish_reason, "usage": usage}


def named(streamed: Streamed) -> list[int]:
    """The index of each call as it was named (a delta with an id): once each where none is named twice."""
    deltas = [c.get("delta") or {} for chunk in streamed.chunks for c in chunk.get("choices") or ()]
    return [call["index"] for d in deltas for call in d.get("tool_calls") or () if call.get("id")]


def without_ids(got: dict[str, Any]) -> dict[str, Any]:
    """The message with its calls' ids left out: each stream names its calls anew (vLLM's ids are random)."""
    return {**got, "tool_calls": [{**c, "id": None} for c in got.get("tool_calls") or ()]}


def same_chat(got: Streamed, want: Streamed, *, what: str) -> bool:
    """Whether the client's stream assembles to ``want``'s; asserts what must hold whatever became of it."""
    assert (got.status, got.done, got.errors) == (200, 1, []), (what, got.errors, got.body[:300])
    assert got.roles == ["assistant"], what
    assert len(got.finish_reasons) == 1, what
    assert named(got) == named(want), what  # every call named once: one begun before a break kept its id
    return without_ids(message(got)) == without_ids(message(want))
