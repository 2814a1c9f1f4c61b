"""The splice as a whole, without servers: the fake engine's chunks, cut anywhere, continued, equal the reference.

The backend here is the fake engine's own generation and chunk shapes (simulate.fakes.tokens and openai_format), driven
without sockets, so hypothesis can try many cut points quickly.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.continuation import continuation
from gateway.splice import Broken, Finished, Splicer
from simulate.fakes.openai_format import DONE, Stream, read_job
from simulate.fakes.tokens import Context, text_of


def backend_events(body: dict[str, Any], *, chat: bool, segment: int, cut_after: int | None) -> list[bytes]:
    """The ``data:`` payloads the fake engine streams for ``body``, ending after ``cut_after`` tokens if given."""
    job = read_job(body, chat=chat, max_model_len=32768)
    out = Stream(chat, f"id-{segment}", 100 + segment, f"model-{segment}", job.token_ids)
    frames = [] if (first := out.first(role=job.role, prompt_ids=job.prompt_ids)) is None else [first]
    context = Context(job.prompt_ids)
    for index in range(job.max_tokens):
        if cut_after is not None and index == cut_after:
            return [f.removeprefix(b"data: ").removesuffix(b"\n\n") for f in frames]
        token = context.next_token()
        context.push(token)
        finish = "length" if index == job.max_tokens - 1 else None
        frames.append(out.token(text_of([token]), [token], finish=finish, stop=None, prompt_ids=None))
    if job.include_usage:
        frames.append(out.usage(len(job.prompt_ids), job.max_tokens))
    frames.append(DONE)
    return [f.removeprefix(b"data: ").removesuffix(b"\n\n") for f in frames]


def play(body: dict[str, Any], *, chat: bool, cuts: list[int]) -> list[Any]:
    """The client's events when the n-th backend is cut after ``cuts[n]`` tokens (the last one is never cut)."""
    splicer = Splicer(chat=chat, include_usage=bool(body.get("stream_options")))
    sent: list[bytes] = []
    request = body
    for segment in range(len(cuts) + 1):
        cut_after = cuts[segment] if segment < len(cuts) else None
        end = None
        for data in backend_events(request, chat=chat, segment=segment, cut_after=cut_after):
            step = splicer.accept(data)
            sent.append(step.out)
            if step.end is not None:
                end = step.end
                break
        if isinstance(end, Finished) or splicer.finished:
            break
        assert end is None or isinstance(end, Broken)
        splicer.next_segment()
        request = continuation(body, splicer, chat=chat)
    sent.append(splicer.tail())
    payloads = [line.removeprefix(b"data: ") for line in b"".join(sent).split(b"\n\n") if line]
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads]


def text_of_events(events: list[Any]) -> str:
    parts = []
    for event in events:
        for choice in event.get("choices", ()) if isinstance(event, dict) else ():
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


@settings(max_examples=150, deadline=None)
@example(chat=False, usage=False, max_tokens=1, cuts=[0], prompt="0")  # cut before its first chunk
@example(chat=True, usage=True, max_tokens=3, cuts=[0, 0, 1], prompt="p")
@given(
    chat=st.booleans(),
    usage=st.booleans(),
    max_tokens=st.integers(min_value=1, max_value=25),
    cuts=st.lists(st.integers(min_value=0, max_value=25), max_size=3),
    prompt=st.text(min_size=1, max_size=30),
)
def test_any_cuts_give_the_reference_stream_with_one_role_one_finish_one_done(
    chat: bool, usage: bool, max_tokens: int, cuts: list[int], prompt: str
) -> None:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if usage:
        body["stream_options"] = {"include_usage": True}
    reference = play(body, chat=chat, cuts=[])
    spliced = play(body, chat=chat, cuts=cuts)
    assert text_of_events(spliced) == text_of_events(reference)
    chunks = [e for e in spliced if isinstance(e, dict)]
    assert spliced.count("[DONE]") == 1
    assert spliced[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        "length"
    ]
    # Every chunk speaks as the first backend the client heard from (a backend cut before its first chunk is none).
    first = chunks[0]
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {(first["id"], first["created"], first["model"])}
    if chat or not cuts or cuts[0] > 0:
        assert first["id"] == "id-0"
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0].get("delta", {})]
    assert len(roles) == (1 if chat else 0)
    assert [c["usage"] for c in chunks if c.get("usage")] == [
        c["usage"] for c in reference if isinstance(c, dict) and c.get("usage")
    ]
