"""Chats that reason and call tools, dropped anywhere on a fake vLLM served with its parsers, continue to the message
the uninterrupted stream assembles to.

The gateway runs with ``--reasoning-parser`` and ``--tool-call-parser hermes``, in front of two fake engines served
with the same parsers (simulate/fakes/thinking.py, simulate/fakes/reasoning_frames.py), each behind a proxy that
drops a chosen stream's connection right after a chosen token: in the reasoning, on ``</think>``, in the answer, in a
call's name or arguments, between two calls. A continuation, through the other proxy, is dropped again at the same
count (a second break). The client's stream, assembled by the ``openai`` package's own stream helper, must be the
uninterrupted one's, and no stream is cut. Without the parsers' flags the gateway cuts them: the test can fail.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import pytest

import tests.engines.cut_proxy as proxies
from simulate.chats import TOOLS
from simulate.fakes.engine import EngineConfig
from simulate.fakes.sse_client import Streamed
from simulate.fakes.thinking import THINK_END, TOOL_END, TOOL_START
from tests.chat_messages import message, same_chat
from tests.engines.test_gateway_vllm import gather_streams
from tests.gateway_harness import FAST_TOKENS_PER_S, engines, gateway, metric

CHAT = "/v1/chat/completions"
REASONING_TOKENS = 40
SPREAD = 6  # cut points per chat spread over its tokens, besides those at its markers


def parsed(parser: str) -> EngineConfig:
    return EngineConfig(
        tokens_per_s=FAST_TOKENS_PER_S,
        reasoning_parser=parser,
        tool_call_parser="hermes",
        auto_tool_choice=True,
        reasoning_tokens=REASONING_TOKENS,
    )


def flags(parser: str) -> tuple[str, ...]:
    return ("--reasoning-parser", parser, "--tool-call-parser", "hermes")


def chat(question: str, *, tools: bool, user: str = "whole", asks_ids: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": user,  # an OpenAI field vLLM passes by: the proxies tell the streams apart by it
    }
    if tools:
        body["tools"] = TOOLS
    return body | {"return_token_ids": True} if asks_ids else body


def ids_of(streamed: Streamed) -> list[list[int]]:
    return [c["token_ids"] for chunk in streamed.chunks for c in chunk.get("choices") or () if c.get("token_ids")]


@dataclass(frozen=True)
class Cut:
    question: str
    tools: bool
    at: int  # tokens after which the stream is dropped
    where: str  # thinking, think_end, answer, call, between_calls


def cuts(question: str, tools: bool, reference: Streamed) -> list[Cut]:
    """After each chunk around a marker, and at chunk ends spread evenly (never after the last)."""
    tokens = [i for ids in ids_of(reference) for i in ids]
    ends = list(accumulate(len(ids) for ids in ids_of(reference)))[:-1]
    end = tokens.index(THINK_END) + 1
    starts = [n + 1 for n, i in enumerate(tokens) if i == TOOL_START]
    closes = [n + 1 for n, i in enumerate(tokens) if i == TOOL_END]

    def where(n: int) -> str:
        if n != end:
            return "thinking" if n < end else "answer" if not starts or n < starts[0] else _in_calls(n)
        return "think_end"

    def _in_calls(n: int) -> str:
        inside = any(s <= n < c for s, c in zip(starts, closes, strict=True))
        return "call" if inside or n >= closes[-1] else "between_calls"

    wanted = {1, end - 1, end, end + 1, end + 3, *(s + k for s in starts for k in (1, 4, 12, 30)), *closes}
    wanted |= {c + 1 for c in closes}
    wanted |= {ends[k * len(ends) // SPREAD] for k in range(SPREAD)}
    return [Cut(question, tools, n, where(n)) for n in sorted(wanted) if n in ends]


@asynccontextmanager
async def keyed_by_user(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    monkeypatch.setattr(proxies, "key_of", lambda body: body.get("user") if isinstance(body, dict) else None)
    yield


async def cut_streams(gw: Any) -> float:
    return sum([await metric(gw, f'spotdrain_gateway_cuts_total{{reason="{r}"}}') for r in ("reasoning", "tool_call")])


QUESTIONS = ("Why does the node drain first?", "What is the weather in Paris?", "Weather in Oslo, time in Tokyo?")


async def planned(port: int) -> tuple[list[Cut], dict[tuple[str, bool], Streamed]]:
    """The cuts for each question, with tools and without, and each chat's uninterrupted stream."""
    calls = [(CHAT, chat(q, tools=t, asks_ids=True)) for q in QUESTIONS for t in (False, True)]
    references = await gather_streams(f"http://127.0.0.1:{port}", calls)
    keys = [(q, t) for q in QUESTIONS for t in (False, True)]
    out = [c for (q, t), r in zip(keys, references, strict=True) for c in cuts(q, t, r)]
    wholes = await gather_streams(f"http://127.0.0.1:{port}", [(CHAT, chat(q, tools=t)) for q, t in keys])
    return out, dict(zip(keys, wholes, strict=True))


async def run_cuts(
    parser: str, monkeypatch: pytest.MonkeyPatch, *, gateway_flags: tuple[str, ...]
) -> tuple[list[Cut], list[Streamed], dict[tuple[str, bool], Streamed], float, int]:
    async with engines(parsed(parser), parsed(parser)) as (one, two):
        plan, want = await planned(one)
        bodies = [chat(c.question, tools=c.tools, user=f"{n}", asks_ids=n % 3 == 0) for n, c in enumerate(plan)]
        async with (
            keyed_by_user(monkeypatch),
            proxies.cut_proxy(f"http://127.0.0.1:{one}") as (first, first_port),
            proxies.cut_proxy(f"http://127.0.0.1:{two}") as (second, second_port),
        ):
            for body, cut in zip(bodies, plan, strict=True):
                first.cuts[body["user"]] = second.cuts[body["user"]] = cut.at
            async with gateway(first_port, second_port, flags=gateway_flags) as gw:
                got = await gather_streams(gw.url(""), [(CHAT, b) for b in bodies])
                cut_count = await cut_streams(gw)
        return plan, got, want, cut_count, len(first.done) + len(second.done)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_parsed_chats_dropped_anywhere_continue_to_the_uninterrupted_message(
    parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan, got, want, cut_count, dropped = await run_cuts(parser, monkeypatch, gateway_flags=flags(parser))
    results = [
        same_chat(g, want[(c.question, c.tools)], what=f"{c.question} tools={c.tools} {c.where} {c.at}")
        for c, g in zip(plan, got, strict=True)
    ]
    assert cut_count == 0
    assert dropped >= len(plan)  # every stream was dropped at least once
    assert all(results), [(c.question, c.tools, c.where, c.at) for c, ok in zip(plan, results, strict=True) if not ok]
    assert {c.where for c in plan} == {"thinking", "think_end", "answer", "call", "between_calls"}
    with_calls = [message(w) for (_, t), w in want.items() if t]
    assert {len(m["tool_calls"]) for m in with_calls} == {1, 2}  # one call, and two, among the chats with tools
    assert all(m["finish_reason"] == "tool_calls" for m in with_calls)
    reasoning = {m["usage"]["completion_tokens_details"]["reasoning_tokens"] for m in map(message, want.values())}
    assert reasoning == ({0} if parser == "deepseek_r1" else {REASONING_TOKENS})


async def test_without_the_parsers_flags_the_gateway_cuts_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same drops in front of a gateway not told the backends' parsers: it cannot replay them, so it cuts."""
    plan, got, _, cut_count, _ = await run_cuts("deepseek_r1", monkeypatch, gateway_flags=())
    ended = [g.done == 0 or bool(g.errors) for g in got]
    assert cut_count == sum(ended) > 0
    # Only a stream dropped before the client had any text may start over (its first token without text).
    assert {c.at for c, cut in zip(plan, ended, strict=True) if not cut} <= {1}


async def test_the_fake_engine_continues_a_chat_by_its_ids_on_completions() -> None:
    """What the gateway relies on: prompt ids and the ids so far on /v1/completions give exactly the rest."""
    async with engines(parsed("qwen3")) as (port,):
        url = f"http://127.0.0.1:{port}"
        (reference,) = await gather_streams(url, [(CHAT, chat(QUESTIONS[2], tools=True, asks_ids=True))])
        prompt, ids = reference.chunks[0]["prompt_token_ids"], [i for c in ids_of(reference) for i in c]
        for n in (3, ids.index(THINK_END) + 1, ids.index(TOOL_START) + 5, len(ids) - 2):
            body = {"prompt": prompt + ids[:n], "max_tokens": 1000, "stream": True, "return_token_ids": True}
            (rest,) = await gather_streams(url, [("/v1/completions", body)])
            assert [i for c in ids_of(rest) for i in c] == ids[n:]
            assert rest.finish_reasons == ["stop"]
        # The call's markers are special tokens here, as on Hermes 2 Pro: their text only where the request keeps
        # special tokens, as the chat's parsers had it (hermes' adjust_request) and the gateway's continuation asks.
        start = ids.index(TOOL_START)
        texts = {}
        for skip in (True, False):
            body = {"prompt": prompt + ids[:start], "max_tokens": 1000, "stream": True, "skip_special_tokens": skip}
            (rest,) = await gather_streams(url, [("/v1/completions", body)])
            texts[skip] = rest.text
        assert texts[False].startswith("<tool_call>\n{")
        assert texts[True] == texts[False].replace("<tool_call>", "").replace("</tool_call>", "")


async def test_a_chat_whose_reasoning_is_hidden_is_cut_once_its_client_has_an_answer() -> None:
    """``include_reasoning: false``: the engine sends no ids (vLLM hides them, lest they leak the reasoning), so
    nothing says where the stream is; broken once its answer began, it is cut, and counted, not continued wrong."""
    faulty = dataclasses.replace(parsed("deepseek_r1"), fault="drop", fault_after=REASONING_TOKENS + 6)
    body = chat(QUESTIONS[1], tools=True) | {"include_reasoning": False}
    async with engines(faulty, parsed("deepseek_r1")) as ports, gateway(*ports, flags=flags("deepseek_r1")) as gw:
        (got,) = await gather_streams(gw.url(""), [(CHAT, body)])
        hidden = await metric(gw, 'spotdrain_gateway_cuts_total{reason="reasoning_hidden"}')
    assert hidden == 1
    assert got.done == 0 or got.errors
    assert not any((c.get("delta") or {}).get("reasoning") for chunk in got.chunks for c in chunk.get("choices") or ())
