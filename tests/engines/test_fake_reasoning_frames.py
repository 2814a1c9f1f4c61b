"""The fake vLLM's reasoning and tool-call frames are real vLLM 0.32's in shape (not in text: other models).

One real vLLM serves the thinking model (simulate/vllm/thinking_model.py) with ``--reasoning-parser deepseek_r1
--enable-auto-tool-choice --tool-call-parser hermes``, and the fake engine (simulate/fakes/thinking.py,
simulate/fakes/reasoning_frames.py) runs with the same flags. The same chats, one without tools and one that calls two,
are streamed from both, with token ids and without, and compared by what a client or the gateway reads of them: the
keys of each kind of chunk and delta, the role chunk, the ``{}`` chunk at ``</think>``, a call named once with its id
then its arguments in pieces, the order of the phases, the finish reasons, the usage's keys and reasoning tokens, the
token-id continuation on ``/v1/completions``, and ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import aiohttp
import pytest

from simulate.fakes.engine import EngineConfig
from simulate.fakes.sse_client import Streamed, read_stream
from simulate.vllm.server import MODEL_NAME, VllmServer
from simulate.vllm.transcripts import Transcript, by_name
from tests.conftest import running_engine
from tests.engines.test_reasoning_model import chat_body

FAKE = EngineConfig(
    tokens_per_s=2000,
    reasoning_parser="deepseek_r1",
    tool_call_parser="hermes",
    auto_tool_choice=True,
    reasoning_tokens=60,
)
CHATS = (by_name("replica"), by_name("two_calls"))  # reasons and answers (stop); reasons, answers, calls twice
ATTEMPTS = 6  # a real stream with steps merged where the comparison reads it comes in about one of five


@pytest.fixture
async def fake() -> AsyncIterator[str]:
    async with running_engine(FAKE) as port:
        yield f"http://127.0.0.1:{port}"


@dataclass(frozen=True)
class Server:
    url: str
    model: str


def both(real: VllmServer, fake: str) -> dict[str, Server]:
    return {"real": Server(real.url, MODEL_NAME), "fake": Server(fake, FAKE.model)}


async def streamed(server: Server, t: Transcript, **extra: Any) -> Streamed:
    request = chat_body(t, model=server.model, stream=True, **extra)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await read_stream(server.url + "/v1/chat/completions", request, session=session)


async def steps_apart(server: Server, t: Transcript, think_end: int, **extra: Any) -> Streamed:
    """``t`` streamed from real vLLM, again (up to ``ATTEMPTS`` in all) while it merged steps where the comparison
    reads the stream. When its API server falls behind the engine, vLLM sends the steps not yet sent as one chunk
    (RequestOutputCollector in vllm/v1/engine/output_processor.py): on 2 cores, most of these chats' streams have a
    chunk or a few of two tokens. Inside a phase (reasoning, content, a call's arguments) that changes no chunk's keys;
    at a phase's first or last chunk, or at ``</think>``, it changes what is compared. Greedy decoding makes the same
    tokens again."""
    for _ in range(ATTEMPTS):
        s = await streamed(server, t, **extra)
        if not merged_where_read(s, think_end):
            break
    return s


def merged_where_read(s: Streamed, think_end: int) -> bool:
    choices = [c for chunk in s.chunks for c in chunk.get("choices") or ()]
    kinds = [kind(c) for c in choices]
    for at, choice in enumerate(choices):
        ids = choice.get("token_ids") or ()
        edge = any(k != kinds[at] for k in kinds[max(0, at - 1) : at + 2])
        if len(ids) > 1 and (think_end in ids or edge):
            return True
        if sum(bool(choice["delta"].get(k)) for k in ("reasoning", "content", "tool_calls")) > 1:
            return True  # two phases' text in one delta: the sign of such a merge where the chunks carry no ids
    return False


def kind(choice: dict[str, Any]) -> str:
    delta = choice["delta"]
    if "role" in delta:
        return "role"
    if choice.get("finish_reason"):
        return "finish"
    if delta.get("tool_calls"):
        return "naming" if any("id" in c for c in delta["tool_calls"]) else "arguments"
    if delta.get("reasoning") is not None:
        return "reasoning"
    if delta.get("content") is not None:
        return "content"
    return "empty" if delta == {} else "other"


def keys(value: Any) -> Any:
    """The structure of a JSON value: an object's keys (in order) with their structures, a list's items'."""
    if isinstance(value, dict):
        return tuple((k, keys(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(sorted({keys(v) for v in value}, key=repr))
    return type(value).__name__


def shapes(s: Streamed) -> dict[str, set[Any]]:
    """Each kind of chunk's shapes: the chunk's keys, its choice's, and its delta's structure."""
    out: dict[str, set[Any]] = {}
    for chunk in s.chunks:
        for choice in chunk.get("choices") or ():
            top = tuple(k for k in chunk if k != "choices")
            rest = {k: v for k, v in choice.items() if k != "delta"}
            out.setdefault(kind(choice), set()).add((top, keys(rest), keys(choice["delta"])))
        if not chunk.get("choices"):
            out.setdefault("usage", set()).add(keys({k: v for k, v in chunk.items() if k not in ("id", "created")}))
    return out


def phases(s: Streamed) -> list[str]:
    """The kinds of chunk in the order they come, each run as one, the chunks without a delta left out."""
    kinds = [kind(c) for chunk in s.chunks for c in chunk.get("choices") or ()]
    return [k for k, _ in groupby(k for k in kinds if k != "empty")]


def think_end_deltas(s: Streamed, think_end: int) -> list[Any]:
    return [
        c["delta"] for chunk in s.chunks for c in chunk.get("choices") or () if think_end in (c.get("token_ids") or ())
    ]


async def post(server: Server, path: str, payload: dict[str, Any]) -> Any:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(server.url + path, json={"model": server.model, **payload}) as answer,
    ):
        assert answer.status == 200, await answer.text()
        return await answer.json()


async def test_the_fakes_chat_frames_are_real_vllms_in_shape(thinking_vllm: VllmServer, fake: str) -> None:
    servers = both(thinking_vllm, fake)
    usage = {"stream_options": {"include_usage": True}}
    ends = {}
    for name, server in servers.items():
        said = await post(server, "/tokenize", {"prompt": "</think>", "add_special_tokens": False})
        (ends[name],) = said["tokens"]
    real = servers["real"]
    for t in CHATS:
        with_ids = {
            "real": await steps_apart(real, t, ends["real"], return_token_ids=True, **usage),
            "fake": await streamed(servers["fake"], t, return_token_ids=True, **usage),
        }
        without = {"real": await steps_apart(real, t, ends["real"]), "fake": await streamed(servers["fake"], t)}
        assert shapes(with_ids["fake"]) == shapes(with_ids["real"]), t.name
        assert shapes(without["fake"]) == shapes(without["real"]), t.name
        assert phases(with_ids["fake"]) == phases(with_ids["real"]), t.name
        every = {"role", "reasoning", "empty", "content", "finish", "usage"} | (
            {"naming", "arguments"} if t.calls else set()
        )
        assert set(shapes(with_ids["real"])) == every, t.name  # each kind of chunk compared
        assert [s.finish_reasons for s in with_ids.values()] == [["tool_calls" if t.calls else "stop"]] * 2
        for name, s in with_ids.items():
            assert think_end_deltas(s, ends[name]) == [{}], name  # alone in its chunk, no delta: sent for its id
            assert think_end_deltas(without[name], ends[name]) == [], name
            details = s.usage[-1]["completion_tokens_details"]
            assert details == {"reasoning_tokens": 0}, name  # deepseek_r1: the <think> was the prompt's
            assert "empty" not in {kind(c) for chunk in without[name].chunks for c in chunk.get("choices") or ()}


async def test_a_chats_ids_continue_on_completions_in_the_same_shape(thinking_vllm: VllmServer, fake: str) -> None:
    t = CHATS[1]
    out = {}
    for name, server in both(thinking_vllm, fake).items():
        s = await streamed(server, t, return_token_ids=True)
        ids = [i for chunk in s.chunks for c in chunk.get("choices") or () for i in c.get("token_ids") or ()]
        request = {"model": server.model, "prompt": s.chunks[0]["prompt_token_ids"] + ids[:20], "max_tokens": 600}
        request |= {"temperature": 0, "stream": True, "return_token_ids": True, "skip_special_tokens": False}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            follow = await read_stream(server.url + "/v1/completions", request, session=session)
        rest = [i for chunk in follow.chunks for c in chunk.get("choices") or () for i in c.get("token_ids") or ()]
        assert rest == ids[20:], name  # exactly the rest, the end of turn's id included
        out[name] = follow
    first = {n: (tuple(f.chunks[0]), tuple(f.chunks[0]["choices"][0])) for n, f in out.items()}
    later = {n: {(tuple(c), tuple(c["choices"][0])) for c in f.chunks[1:] if c.get("choices")} for n, f in out.items()}
    assert first["fake"] == first["real"]
    assert later["fake"] == later["real"]
    assert [f.finish_reasons for f in out.values()] == [["stop"], ["stop"]]


async def test_tokenize_and_detokenize_answer_as_vllms(thinking_vllm: VllmServer, fake: str) -> None:
    said = {}
    for name, server in both(thinking_vllm, fake).items():
        think = await post(server, "/tokenize", {"prompt": "<think></think>", "add_special_tokens": False})
        call = await post(server, "/tokenize", {"prompt": "<tool_call>", "add_special_tokens": False})
        text = await post(server, "/detokenize", {"tokens": think["tokens"] + call["tokens"]})
        said[name] = (sorted(think), think["count"], len(call["tokens"]), text)
        assert text == {"prompt": "<think></think><tool_call>"}, name
    assert said["fake"] == said["real"]
    assert json.dumps(said["fake"][0]) == '["count", "max_model_len", "token_strs", "tokens"]'


async def test_a_whole_chat_answers_with_the_parsers_message_as_vllms(thinking_vllm: VllmServer, fake: str) -> None:
    """Not streamed: the message's reasoning, content and calls (each with its id and its arguments as a JSON
    string), the finish reason and the usage's reasoning tokens, in the same shape."""
    for t in CHATS:
        answers = {}
        for name, server in both(thinking_vllm, fake).items():
            request = chat_body(t, model=server.model, return_token_ids=True)
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session,
                session.post(server.url + "/v1/chat/completions", json=request) as answer,
            ):
                answers[name] = await answer.json()
        shape = {n: keys({k: v for k, v in a.items() if k not in ("id", "created")}) for n, a in answers.items()}
        assert shape["fake"] == shape["real"], t.name
        for name, answer in answers.items():
            choice = answer["choices"][0]
            assert choice["finish_reason"] == ("tool_calls" if t.calls else "stop"), name
            calls = choice["message"].get("tool_calls") or []
            assert [json.loads(c["function"]["arguments"]) is not None for c in calls] == [True] * len(t.calls), name
            assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}, name
