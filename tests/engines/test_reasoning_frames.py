"""What real vLLM 0.32 streams for chats that reason and call tools, and that a cut one continues exactly.

The thinking model (simulate/vllm/thinking_model.py) is served twice, with ``--reasoning-parser deepseek_r1`` and with
``qwen3``, both with ``--enable-auto-tool-choice --tool-call-parser hermes``. Each transcript's chat is streamed
once with ``return_token_ids`` (as the gateway asks for it, gateway/token_ids.py) and the same prompt's ids once on
``/v1/completions`` (the raw text, token by token, that the parsers split). The frames are recorded as facts the
continuation is built on. Then each stream is cut at points around its markers and elsewhere and continued by ids on
``/v1/completions``: the deltas gateway.reasoning makes of the continuation, after the ones vLLM sent before the cut,
must add up to the message of the stream that was never cut, and be, chunk by chunk, those of vLLM's own replay of
its parsers (``/v1/chat/completions/derender``, served with ``--enable-scale-out``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from gateway.reasoning import ChatParsers, Markers, Piece, assembled, continued, finish_reason, reasoning_tokens
from gateway.tool_calls import Delta
from simulate.fakes.processes import free_port
from simulate.fakes.sse_client import Streamed, read_stream
from simulate.vllm.server import MODEL_NAME, VllmServer
from simulate.vllm.transcripts import TRANSCRIPTS, Transcript
from tests.engines.conftest import SCALE_OUT, TOOLS
from tests.engines.test_reasoning_model import chat_body

PARSERS = ("deepseek_r1", "qwen3")
SHARED = "deepseek_r1"  # the session's server (THINKING_ARGS)
MAX_TOKENS = 600
EOS = "<|im_end|>"


@dataclass(frozen=True)
class Recorded:
    """One transcript's chat as vLLM streamed it, and the same prompt's raw completion."""

    chat: Streamed
    raw: Streamed

    @property
    def prompt_ids(self) -> list[int]:
        ids: list[int] = self.chat.chunks[0]["prompt_token_ids"]
        return ids

    @property
    def choices(self) -> list[dict[str, Any]]:
        return [c for chunk in self.chat.chunks for c in chunk.get("choices") or () if "token_ids" in c]

    @property
    def ids(self) -> list[int]:
        return [i for c in self.choices for i in c["token_ids"]]

    @property
    def deltas(self) -> list[Delta]:
        return [c["delta"] for c in self.choices]

    @property
    def pieces(self) -> list[Piece]:
        return pieces(self.raw)


@dataclass
class Served:
    server: VllmServer
    parsers: ChatParsers
    recorded: dict[str, Recorded]


def pieces(raw: Streamed) -> list[Piece]:
    return [Piece(c["text"], tuple(c["token_ids"])) for chunk in raw.chunks for c in chunk.get("choices") or ()]


@pytest.fixture(scope="module")
def served(
    thinking_vllm: VllmServer, thinking_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Served]]:
    """A real vLLM for each parser: deepseek_r1's the session's (``THINKING_ARGS``), the others started here."""
    log_dir = tmp_path_factory.mktemp("reasoning")
    own = {
        name: VllmServer(
            free_port(), thinking_vllm_model, log_dir / f"{name}.log", ("--reasoning-parser", name, *TOOLS, SCALE_OUT)
        )
        for name in PARSERS
        if name != SHARED
    }
    try:
        for server in own.values():
            server.start()
        for server in own.values():
            server.wait_ready()
        servers = {SHARED: thinking_vllm, **own}
        yield {name: _recorded(name, servers[name]) for name in PARSERS}
    finally:
        for server in own.values():
            server.stop()


def _recorded(name: str, server: VllmServer) -> Served:
    said = httpx.post(f"{server.url}/tokenize", json={"prompt": f"<think></think><|im_start|>{EOS}"}, timeout=30)
    start, end, *boundaries = said.json()["tokens"]
    parsers = ChatParsers(name, "hermes", Markers(start, end, frozenset(boundaries)))
    return Served(server, parsers, asyncio.run(_record(server.url)))


async def _record(url: str) -> dict[str, Recorded]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        out = {}
        for t in TRANSCRIPTS:
            body = chat_body(t, return_token_ids=True, stream_options={"include_usage": True})
            chat = await read_stream(f"{url}/v1/chat/completions", body, session=session)
            prompt = chat.chunks[0]["prompt_token_ids"]
            raw = await read_stream(f"{url}/v1/completions", completion(prompt, MAX_TOKENS), session=session)
            out[t.name] = Recorded(chat, raw)
        return out


def completion(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    # skip_special_tokens false, as the parsers' adjust_request sets it for the chat (hermes with tools, qwen3).
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
    }


def by_transcript(served: dict[str, Served]) -> Iterator[tuple[Served, Transcript, Recorded]]:
    for one in served.values():
        for t in TRANSCRIPTS:
            yield one, t, one.recorded[t.name]


def test_reasoning_comes_in_the_reasoning_field_one_token_a_delta(served: dict[str, Served]) -> None:
    for _, t, recorded in by_transcript(served):
        assert not any("reasoning_content" in d for d in recorded.deltas)
        assert "".join(d.get("reasoning") or "" for d in recorded.deltas) == t.reasoning
        assert all(set(d) == {"reasoning"} for d in recorded.deltas if d.get("reasoning"))


def test_the_first_chunk_is_the_role_with_the_prompt_ids_and_no_token_ids(served: dict[str, Served]) -> None:
    for _, _, recorded in by_transcript(served):
        first = recorded.chat.chunks[0]
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "token_ids" not in first["choices"][0]
        assert recorded.prompt_ids == recorded.raw.chunks[0]["choices"][0]["prompt_token_ids"]


def test_the_end_of_reasoning_is_a_chunk_with_no_delta_but_its_token_id(served: dict[str, Served]) -> None:
    for one, _, recorded in by_transcript(served):
        assert one.parsers.markers is not None
        end = one.parsers.markers.think_end
        marked = [c for c in recorded.choices if end in c["token_ids"]]
        assert len(marked) == 1
        if marked[0]["token_ids"] == [end]:  # alone in its chunk, as it is unless the engine batched tokens
            assert marked[0]["delta"] == {}
        assert not any("</think>" in json.dumps(d) for d in recorded.deltas)


def test_a_tool_call_is_named_with_its_id_first_then_its_arguments_in_pieces(served: dict[str, Served]) -> None:
    for _, t, recorded in by_transcript(served):
        calls = [c for d in recorded.deltas for c in d.get("tool_calls") or ()]
        assert all(d.get("content") is None for d in recorded.deltas if d.get("tool_calls"))
        for index, call in enumerate(t.calls):
            mine = [c for c in calls if c["index"] == index]
            first, *rest = mine
            assert first["id"].startswith("chatcmpl-tool-")
            assert first["type"] == "function"
            assert first["function"] == {"name": call.name}
            assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"} for c in rest)
            assert "".join(c["function"]["arguments"] for c in rest) == json.dumps(call.arguments)
        assert len(calls) == sum(1 for c in calls if "id" in c) + sum(1 for c in calls if "id" not in c)
        assert len({c["index"] for c in calls}) == len(t.calls)


def test_the_finish_and_usage_count_every_token_and_the_reasoning_as_each_parser_does(
    served: dict[str, Served],
) -> None:
    for one, t, recorded in by_transcript(served):
        finished = [c for c in recorded.choices if c["finish_reason"]]
        assert [c["finish_reason"] for c in finished] == ["tool_calls" if t.calls else "stop"]
        assert recorded.choices[-1] is finished[0]
        usage = recorded.chat.usage[-1]
        assert usage["completion_tokens"] == len(recorded.ids)
        assert recorded.ids == [i for p in recorded.pieces for i in p.ids]  # the end of turn's id included
        counted = usage["completion_tokens_details"]["reasoning_tokens"]
        assert counted == reasoning_tokens(one.parsers, recorded.ids)
        if one.parsers.reasoning == "deepseek_r1":
            assert counted == 0  # its <think> is the prompt's: no start marker among the generated ids


def cuts(recorded: Recorded, markers: Markers, tool_start: int) -> list[int]:
    """Token counts to cut after: around the end of the reasoning and the first call, and elsewhere; only where
    both streams end a chunk and the raw text is not in the middle of a character."""
    ids = recorded.ids
    end = ids.index(markers.think_end)
    call = ids.index(tool_start) if tool_start in ids else None
    wanted = [1, end, end + 1, end + 3, len(ids) - 2]
    if call is not None:
        wanted += [call + 1, call + 6, call + 14, len(ids) - 12]
    ends = _ends(recorded)
    return sorted({n for n in wanted if 0 < n < len(ids) and n in ends})


def _ends(recorded: Recorded) -> set[int]:
    """The token counts where both streams end a chunk and the raw text is not in the middle of a character."""
    chat_ends = set(accumulate(len(c["token_ids"]) for c in recorded.choices))
    raw = recorded.pieces
    return chat_ends & {n for n, p in zip(accumulate(len(p.ids) for p in raw), raw, strict=True) if p.text}


def chunk_end(recorded: Recorded, n: int) -> int:
    """The last of ``_ends`` at or before ``n``: a stream breaks between chunks, and vLLM puts several tokens in one
    chunk when its API server falls behind the engine."""
    return max(k for k in _ends(recorded) if k <= n)


def before_cut(recorded: Recorded, n: int) -> tuple[list[Delta], list[Piece]]:
    sent = list(accumulate(len(c["token_ids"]) for c in recorded.choices)).index(n) + 1
    raw = list(accumulate(len(p.ids) for p in recorded.pieces)).index(n) + 1
    return recorded.deltas[:sent], recorded.pieces[:raw]


def without_new_ids(message: Delta, kept: set[int]) -> Delta:
    calls = [c if c["index"] in kept else {**c, "id": None} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


async def _continue(url: str, prompt: list[int], max_tokens: int) -> Streamed:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await read_stream(f"{url}/v1/completions", completion(prompt, max_tokens), session=session)


@pytest.mark.parametrize("name", PARSERS)
def test_a_cut_chat_continued_on_completions_adds_up_to_the_uncut_message(served: dict[str, Served], name: str) -> None:
    one = served[name]
    markers = one.parsers.markers
    assert markers is not None
    tool_start = httpx.post(f"{one.server.url}/tokenize", json={"prompt": "<tool_call>"}, timeout=30).json()
    tried = 0
    for t in TRANSCRIPTS:
        recorded = one.recorded[t.name]
        whole = assembled(recorded.deltas)
        for n in cuts(recorded, markers, tool_start["tokens"][0]):
            sent, before = before_cut(recorded, n)
            follow = asyncio.run(_continue(one.server.url, recorded.prompt_ids + recorded.ids[:n], MAX_TOKENS - n))
            after = pieces(follow)
            assert [i for p in after for i in p.ids] == recorded.ids[n:], (t.name, n)
            rest, tools_streamed = continued(one.parsers, recorded.prompt_ids, before, after)
            # What came before may be one piece, vLLM's /detokenize of its ids: the replay ends in the same state.
            text = httpx.post(f"{one.server.url}/detokenize", json={"tokens": recorded.ids[:n]}, timeout=30).json()
            one_piece = [Piece(text["prompt"], tuple(recorded.ids[:n]))]
            assert continued(one.parsers, recorded.prompt_ids, one_piece, after, new_id=lambda: "new") == continued(
                one.parsers, recorded.prompt_ids, before, after, new_id=lambda: "new"
            ), (t.name, n)
            begun = {c["index"] for d in sent for c in d.get("tool_calls") or () if "id" in c}
            got = assembled([*sent, *rest])
            assert without_new_ids(got, begun) == without_new_ids(whole, begun), (t.name, n)
            reason = finish_reason(follow.finish_reasons[-1], tools_streamed=tools_streamed)
            assert reason == recorded.chat.finish_reasons[-1], (t.name, n)
            tried += 1
    assert tried >= 20


def derendered(one: Served, t: Transcript, recorded: Recorded, n: int, follow: Streamed) -> list[Delta]:
    """vLLM's own deltas for the continuation: each of its chunks through ``/v1/chat/completions/derender``, with
    the state of a stream that generated ``recorded.ids[:n]`` in the chunks it was sent in (the client carries
    it: vllm/entrypoints/scale_out/token_in_token_out/protocol.py, ``DerenderStreamState``)."""
    sent, _ = before_cut(recorded, n)
    state: dict[str, Any] = {
        "output_token_ids": recorded.ids[:n],
        "output_chunk_lens": [len(c["token_ids"]) for c in recorded.choices[: len(sent)]],
        "role_sent": True,
        "last_tool_call_ids": [c["id"] for d in sent for c in d.get("tool_calls") or () if "id" in c],
    }
    state["tools_streamed"] = bool(state["last_tool_call_ids"])
    out = []
    for chunk in follow.chunks:
        choice = chunk["choices"][0]
        generated = {"choices": [{k: choice[k] for k in ("index", "token_ids", "finish_reason")}]}
        body = {
            "stream": True,
            "generate_chunk": generated,
            "stream_state": state,
            "prompt_token_ids": recorded.prompt_ids,
            "chat_request": chat_body(t, return_token_ids=True),
        }
        answer = httpx.post(f"{one.server.url}/v1/chat/completions/derender", json=body, timeout=60).json()
        state = answer["stream_state"]
        out.append(answer["chunk"]["choices"][0]["delta"])
    return out


def set_fields(value: Any) -> Any:
    """A delta without the fields at null: derender writes every field, the chat stream only those set."""
    if isinstance(value, dict):
        return {k: set_fields(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [set_fields(v) for v in value]
    return value


@pytest.mark.parametrize("name", PARSERS)
def test_our_deltas_for_a_continuation_are_vllms_own_chunk_by_chunk(served: dict[str, Served], name: str) -> None:
    one = served[name]
    assert one.parsers.markers is not None
    t = TRANSCRIPTS[-1]  # the end of reasoning, white space as content, then a call: every phase in few tokens
    recorded = one.recorded[t.name]
    n = chunk_end(recorded, recorded.ids.index(one.parsers.markers.think_end) - 2)
    follow = asyncio.run(_continue(one.server.url, recorded.prompt_ids + recorded.ids[:n], MAX_TOKENS - n))
    ours, _ = continued(one.parsers, recorded.prompt_ids, before_cut(recorded, n)[1], pieces(follow))
    theirs = [set_fields(d) for d in derendered(one, t, recorded, n, follow)]
    mine = [set_fields(d or {}) for d in ours]
    assert sum(1 for d in theirs for c in d.get("tool_calls") or () if "id" in c) == len(t.calls)
    for delta in (*mine, *theirs):
        for call in delta.get("tool_calls") or ():
            call.pop("id", None)  # a call named after the cut gets a new id, both ways
    assert mine == theirs


async def _chat_from_ids(url: str, t: Transcript, ids: list[int], max_tokens: int) -> Streamed:
    # vllm/renderers/online_renderer.py _reused_prompt_token_ids: disaggregated serving's ids skip the template.
    body = chat_body(t, return_token_ids=True, max_tokens=max_tokens, kv_transfer_params={"prompt_token_ids": ids})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await read_stream(f"{url}/v1/chat/completions", body, session=session)


@pytest.mark.parametrize("name", PARSERS)
def test_a_chat_given_its_ids_so_far_continues_through_vllms_parsers_except_inside_a_call(
    served: dict[str, Served], name: str
) -> None:
    """``kv_transfer_params.prompt_token_ids`` on /v1/chat/completions: the parsers start afresh after the cut,
    deciding the reasoning from the ids (``is_reasoning_end``), so reasoning and content continue right; a call
    begun before the cut is lost, its rest comes as content, and the stream finishes ``stop``."""
    one = served[name]
    assert one.parsers.markers is not None
    for t, inside_a_call in ((TRANSCRIPTS[0], False), (TRANSCRIPTS[3], True)):
        recorded = one.recorded[t.name]
        end = recorded.ids.index(one.parsers.markers.think_end)
        n = chunk_end(recorded, len(recorded.ids) - 6 if inside_a_call else end // 2)
        sent, _ = before_cut(recorded, n)
        prompt = recorded.prompt_ids + recorded.ids[:n]
        follow = asyncio.run(_chat_from_ids(one.server.url, t, prompt, MAX_TOKENS - n))
        assert follow.chunks[0]["prompt_token_ids"] == prompt
        rest = [c["delta"] for chunk in follow.chunks for c in chunk.get("choices") or () if "token_ids" in c]
        got, whole = assembled([*sent, *rest]), assembled(recorded.deltas)
        assert got["reasoning"] == whole["reasoning"]
        if inside_a_call:
            assert got["tool_calls"] == assembled(sent)["tool_calls"] != whole["tool_calls"]  # only what was sent
            assert got["content"].startswith(whole["content"])
            assert got["content"].endswith("}}\n</tool_call>")
            assert follow.finish_reasons == ["stop"]
        else:
            assert got == whole
