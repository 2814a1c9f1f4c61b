"""The splice as a whole, without servers: the fake engine's chunks, cut anywhere, continued, equal the reference.

The backend here is the fake engine's own generation and chunk shapes (simulate.fakes.tokens and openai_format),
driven without sockets, so hypothesis can try many cut points quickly. Its tokens include halves of multi-byte
characters (empty-text chunks) and it echoes the decoded prompt when a token-id prompt ends inside a character, as
vLLM 0.32.0 does: the gateway's continuation must avoid both, whatever the cut.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gateway.continuation import continuation
from gateway.ends import Broken, Finished
from gateway.splice import Splicer
from gateway.token_ids import FIELD
from simulate.fakes.openai_format import DONE, Stream, chunk_size, read_job
from simulate.fakes.tokens import Context, Detokenizer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def backend_events(
    path: str, body: dict[str, Any], *, segment: int, cut_after: int | None, ids: bool = True, merge: int = 1
) -> list[bytes]:
    """The ``data:`` payloads the fake engine streams for ``body``, ending after ``cut_after`` tokens if given.

    The gateway asks for token ids itself (``ids``), as it does of a backend that takes them; ``merge``: up to that
    many tokens per chunk, as a loaded vLLM sends them (the fake engine's ``--merge-steps``)."""
    chat = path == CHAT
    body = {**body, FIELD: True} if ids else {k: v for k, v in body.items() if k != FIELD}
    job = read_job(body, chat=chat, max_model_len=32768)
    out = Stream(chat, f"id-{segment}", 100 + segment, f"model-{segment}", job.token_ids, job.include_usage)
    frames = [] if (first := out.first(role=job.role, prompt_ids=job.prompt_ids)) is None else [first]
    context, detokenizer = Context(job.prompt_ids), Detokenizer(job.prompt_ids)
    texts: list[str] = []
    tokens: list[int] = []
    for index in range(job.max_tokens):
        if cut_after is not None and index == cut_after:
            return [f.removeprefix(b"data: ").removesuffix(b"\n\n") for f in frames]
        token = context.next_token()
        context.push(token)
        texts.append(detokenizer.step(token))
        tokens.append(token)
        finish = "length" if index == job.max_tokens - 1 else None
        if finish is None and len(tokens) < chunk_size(tokens[0], merge):
            continue
        prompt_ids = job.prompt_ids if index + 1 == len(tokens) else None
        frames.append(out.token("".join(texts), tokens, finish=finish, stop=None, prompt_ids=prompt_ids))
        texts, tokens = [], []
    if job.include_usage:
        frames.append(out.usage(len(job.prompt_ids), job.max_tokens))
    frames.append(DONE)
    return [f.removeprefix(b"data: ").removesuffix(b"\n\n") for f in frames]


def play(body: dict[str, Any], *, chat: bool, cuts: list[int], ids: bool = True, merge: int = 1) -> list[Any]:
    """The client's events when the n-th backend is cut after ``cuts[n]`` tokens (the last one is never cut).

    The decisions are the gateway's (gateway.streaming): the splicer's next segment, rewound to where the ids end a
    character when it continues by ids; the client's own request again when nothing generated reached it."""
    path = CHAT if chat else COMPLETIONS
    splicer = Splicer(chat=chat, include_usage=bool(body.get("stream_options")), hide_ids=body.get(FIELD) is not True)
    sent: list[bytes] = []
    request_path, request = path, body
    for segment in range(len(cuts) + 1):
        cut_after = cuts[segment] if segment < len(cuts) else None
        end = None
        events = backend_events(request_path, request, segment=segment, cut_after=cut_after, ids=ids, merge=merge)
        for data in events:
            step = splicer.accept(data)
            sent.append(step.out)
            if step.end is not None:
                end = step.end
                break
        if isinstance(end, Finished) or splicer.finished:
            break
        assert end is None or isinstance(end, Broken)
        splicer.next_segment()
        if not splicer.continuing:
            request_path, request = path, body
            splicer.source_chat = None
            continue
        plan = continuation(body, splicer, chat=chat, path=path)
        if plan.method == "token_ids":
            splicer.rewind()
        splicer.source_chat = plan.chat
        request_path, request = plan.path, plan.body
    sent.append(splicer.tail())
    payloads = [line.removeprefix(b"data: ") for line in b"".join(sent).split(b"\n\n") if line]
    return [p.decode() if p == b"[DONE]" else json.loads(p) for p in payloads]


def text_of_events(events: list[Any]) -> str:
    parts = []
    for event in events:
        for choice in event.get("choices", ()) if isinstance(event, dict) else ():
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def ids_of_events(events: list[Any]) -> list[int]:
    return [i for e in events if isinstance(e, dict) for c in e.get("choices", ()) for i in (c.get("token_ids") or ())]


@settings(max_examples=200, deadline=None)
@example(chat=False, usage=False, asked=False, max_tokens=1, cuts=[0], prompt="0", merge=1)  # cut before any chunk
@example(chat=True, usage=True, asked=True, max_tokens=3, cuts=[0, 0, 1], prompt="p", merge=1)
@example(chat=False, usage=False, asked=False, max_tokens=7, cuts=[0, 6], prompt="0", merge=1)  # ids from a restart
@given(
    chat=st.booleans(),
    usage=st.booleans(),
    asked=st.booleans(),
    max_tokens=st.integers(min_value=1, max_value=25),
    cuts=st.lists(st.integers(min_value=0, max_value=25), max_size=3),
    prompt=st.text(min_size=1, max_size=30),
    merge=st.integers(min_value=1, max_value=4),
)
def test_any_cuts_give_the_reference_stream_with_one_role_one_finish_one_done(
    chat: bool, usage: bool, asked: bool, max_tokens: int, cuts: list[int], prompt: str, merge: int
) -> None:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    if usage:
        body["stream_options"] = {"include_usage": True}
    if asked:
        body[FIELD] = True
    reference = play(body, chat=chat, cuts=[])
    spliced = play(body, chat=chat, cuts=cuts, merge=merge)
    assert text_of_events(spliced) == text_of_events(reference)
    assert ids_of_events(spliced) == ids_of_events(reference)
    assert (ids_of_events(reference) == []) is not asked  # the gateway's own ids never reach the client
    chunks = [e for e in spliced if isinstance(e, dict)]
    assert spliced.count("[DONE]") == 1
    assert spliced[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        "length"
    ]
    # Every chunk speaks as the first backend the client heard from (a backend cut before its first chunk is none).
    first = chunks[0]
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {(first["id"], first["created"], first["model"])}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    path = CHAT if chat else COMPLETIONS
    if not cuts or backend_events(path, body, segment=0, cut_after=cuts[0], merge=merge):
        assert first["id"] == "id-0"
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0].get("delta", {})]
    assert len(roles) == (1 if chat else 0)
    assert [c["usage"] for c in chunks if c.get("usage")] == [
        c["usage"] for c in reference if isinstance(c, dict) and c.get("usage")
    ]


def _empty_text_positions(body: dict[str, Any], *, chat: bool) -> list[int]:
    """The token counts after which the reference has just streamed a chunk with empty text."""
    chunks = [e for e in play(body, chat=chat, cuts=[]) if isinstance(e, dict) and e["choices"]]
    texts = [c["choices"][0].get("text", (c["choices"][0].get("delta") or {}).get("content")) for c in chunks]
    if chat:
        texts = texts[1:]  # the role delta
    return [index + 1 for index, text in enumerate(texts) if text == ""]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_cut_right_after_an_empty_text_token_neither_echoes_the_prompt_nor_repeats_a_token(chat: bool) -> None:
    cuts = 0
    for prompt in ("drain", "node", "spot", "stream"):
        body: dict[str, Any] = {"max_tokens": 60, "stream": True, "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        reference = play(body, chat=chat, cuts=[])
        assert reference[-2]["usage"]["completion_tokens"] == 60
        for cut in _empty_text_positions(body, chat=chat):
            spliced = play(body, chat=chat, cuts=[cut])
            assert text_of_events(spliced) == text_of_events(reference), (prompt, cut)
            assert spliced[-2]["usage"] == reference[-2]["usage"], (prompt, cut)
            cuts += 1
    assert cuts >= 3  # the fake's split characters leave several held-back halves in 240 tokens


def _merged_chunks_ending_inside_a_character(body: dict[str, Any], *, merge: int) -> list[int]:
    """The token counts after which the reference (``merge`` tokens per chunk at most) has just streamed a chunk of
    several tokens with text whose last token starts a character it leaves out."""
    chunks = [e for e in play(body, chat=False, cuts=[], merge=merge) if isinstance(e, dict) and e["choices"]]
    ends, count = [], 0
    for chunk in chunks:
        choice = chunk["choices"][0]
        count += len(choice["token_ids"])
        if len(choice["token_ids"]) > 1 and choice["text"] and Detokenizer().step(choice["token_ids"][-1]) == "":
            ends.append(count)
    return ends


def test_a_cut_after_a_merged_chunk_whose_last_token_starts_a_character_does_not_echo_the_prompt() -> None:
    """A loaded vLLM merges steps into one chunk: its text says nothing of its last token, which may hold the first
    byte of a character. Continuing after it would end the prompt inside a character."""
    cuts = 0
    for prompt in ("drain", "node", "spot", "stream", "gpu", "queue"):
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 80, "stream": True, FIELD: True}
        body["stream_options"] = {"include_usage": True}
        reference = play(body, chat=False, cuts=[])
        for cut in _merged_chunks_ending_inside_a_character(body, merge=3):
            spliced = play(body, chat=False, cuts=[cut], merge=3)
            assert text_of_events(spliced) == text_of_events(reference), (prompt, cut)
            assert ids_of_events(spliced) == ids_of_events(reference), (prompt, cut)
            assert spliced[-2]["usage"] == reference[-2]["usage"], (prompt, cut)
            cuts += 1
    assert cuts >= 3


def test_continuing_right_after_an_empty_text_token_is_what_makes_the_fake_echo_its_prompt() -> None:
    """The trap the gateway steps around, in the fake as in vLLM: prompt ids ending inside a character."""
    body: dict[str, Any] = {"prompt": "drain", "max_tokens": 60, "stream": True, FIELD: True}
    reference = play(body, chat=False, cuts=[])
    cut = next(c for c in _empty_text_positions(body, chat=False) if text_of_events(reference[:c]))
    sent = text_of_events(reference[:cut])
    prompt = reference[0]["choices"][0]["prompt_token_ids"]
    naive = {"prompt": [*prompt, *ids_of_events(reference)[:cut]], "max_tokens": 60 - cut, "stream": True}
    first = json.loads(backend_events(COMPLETIONS, naive, segment=1, cut_after=None)[0])
    assert first["choices"][0]["text"].startswith(sent)  # what the client already has, once more


@settings(max_examples=60, deadline=None)
@given(
    chat=st.booleans(),
    max_tokens=st.integers(min_value=1, max_value=20),
    cuts=st.lists(st.integers(min_value=1, max_value=20), max_size=2),
)
def test_a_backend_without_ids_continues_by_text_with_the_same_one_finish_and_done(
    chat: bool, max_tokens: int, cuts: list[int]
) -> None:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True}
    body |= {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    spliced = play(body, chat=chat, cuts=cuts, ids=False)
    assert spliced.count("[DONE]") == 1
    finishes = [e["choices"][0]["finish_reason"] for e in spliced if isinstance(e, dict) and e["choices"]]
    assert [f for f in finishes if f] == ["length"]
