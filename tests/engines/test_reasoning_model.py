"""The thinking model says its transcripts on real vLLM 0.32, decoding greedily: reasoning, answer and tool calls."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from simulate.vllm.server import MODEL_NAME, VllmServer
from simulate.vllm.transcripts import TRANSCRIPTS, Transcript


def chat_body(t: Transcript, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "messages": t.messages, "max_tokens": 600, "temperature": 0}
    if t.tools:
        body["tools"] = t.tools
    return body | extra


@pytest.mark.parametrize("t", TRANSCRIPTS, ids=[t.name for t in TRANSCRIPTS])
def test_the_model_reasons_answers_and_calls_tools_as_its_transcript_says(
    thinking_vllm: VllmServer, t: Transcript
) -> None:
    answer = httpx.post(f"{thinking_vllm.url}/v1/chat/completions", json=chat_body(t), timeout=120).json()
    choice = answer["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == t.reasoning
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]
    assert calls == [(c.name, c.arguments) for c in t.calls]
    # Not streamed, the hermes parser gives what precedes the first call, None where that is only white space.
    assert message["content"] == (t.content if t.content.strip() else None)
    assert choice["finish_reason"] == ("tool_calls" if t.calls else "stop")


@pytest.mark.parametrize("t", TRANSCRIPTS, ids=[t.name for t in TRANSCRIPTS])
def test_the_same_prompt_ids_on_completions_give_the_transcripts_raw_text(
    thinking_vllm: VllmServer, t: Transcript
) -> None:
    chat = chat_body(t, return_token_ids=True)
    ids = httpx.post(f"{thinking_vllm.url}/v1/chat/completions", json=chat, timeout=120).json()["prompt_token_ids"]
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 600, "temperature": 0}
    answer = httpx.post(f"{thinking_vllm.url}/v1/completions", json=body, timeout=120).json()
    assert answer["choices"][0]["text"] == t.completion
    assert answer["choices"][0]["finish_reason"] == "stop"
