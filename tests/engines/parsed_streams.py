"""Chats that reason and call tools, streamed through the gateway: what their client assembles, and where a break fell.

Whether a stream assembles to the uninterrupted one's is tests/chat_messages.py's ``same_chat``. For a server ended
(SIGKILL, SIGTERM) under many streams, ``in_waves`` starts them so that the end finds many inside a tool call:
greedy streams of one chat on one vLLM advance a token a step together (one batch), so a stream started ``n`` tokens
after another is ``n`` tokens behind it from then on. Each stream is started when the lead one (the first, asking
for its token ids: the clock) is as far ahead of it as the test wants it to be behind when the server ends. Where a
break fell is then read from the stream itself: what its client had received before the splice comment
(``broken_at``), never from the plan.
"""

from __future__ import annotations

import asyncio
import json
from bisect import bisect_right
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from simulate.fakes.sse_client import Streamed
from simulate.vllm.server import VllmServer
from simulate.vllm.transcripts import TRANSCRIPTS, Transcript
from tests.engines.test_gateway_vllm import gather_streams, through
from tests.engines.test_reasoning_model import chat_body
from tests.gateway_harness import Running

CHAT = "/v1/chat/completions"
SPLICE = ": spotdrain: continued"  # the comment the gateway writes where a continuation starts
IN_CALLS = ("name", "arguments", "call", "between_calls")  # call: the proxy-drop tests' label
AHEAD = 4  # tokens a stream may get past where its client saw it when the server ends: the gateway relays them
# Streams per chat ended before their calls (reasoning-only chats, and those with calls, cut before them), and of all
# chats ended inside them: at least 20 of each path continued, as the client's stream shows.
BEFORE_CALLS, INSIDE_CALLS = 8, 30


def request(t: Transcript, name: str, *, asks_ids: bool = False) -> tuple[str, dict[str, Any]]:
    """The transcript's chat, told apart from its other streams by ``user`` (an OpenAI field vLLM passes by)."""
    body = chat_body(t, user=name, stream_options={"include_usage": True})
    return CHAT, body | {"return_token_ids": True} if asks_ids else body


async def uninterrupted(server: VllmServer) -> dict[str, Streamed]:
    """Each transcript's stream straight from ``server``, with its token ids (to place breaks, and to compare)."""
    wholes = await gather_streams(server.url, [request(t, "whole", asks_ids=True) for t in TRANSCRIPTS])
    return {t.name: w for t, w in zip(TRANSCRIPTS, wholes, strict=True)}


def token_ids(streamed: Streamed) -> list[int | None]:
    """Every id the stream's chunks carry; None for a chunk without (the client did not ask)."""
    out: list[int | None] = []
    for choice in (c for chunk in streamed.chunks for c in chunk.get("choices") or () if "token_ids" in c):
        out += [None] if choice["token_ids"] is None else choice["token_ids"]
    return out


def fractions(results: list[tuple[str, bool]]) -> dict[str, str]:
    paths = sorted({p for p, _ in results})
    return {p: f"{sum(ok for q, ok in results if q == p)}/{sum(q == p for q, _ in results)}" for p in paths}


def broken_at(t: Transcript, streamed: Streamed) -> str | None:
    """Where the stream first broke, from the deltas its client had by then: thinking, answer, a call's name (named,
    no arguments yet), its arguments, between two calls (the first's arguments whole); None if it never broke."""
    pairs = zip(streamed.comments_at, streamed.comments, strict=True)
    at = next((n for n, line in pairs if line.startswith(SPLICE)), None)
    if at is None:
        return None
    deltas = [c.get("delta") or {} for chunk in streamed.chunks[:at] for c in chunk.get("choices") or ()]
    calls = [call for d in deltas for call in d.get("tool_calls") or ()]
    if not calls:
        return "answer" if any(d.get("content") for d in deltas) else "thinking"
    last = calls[-1]["index"]
    arguments = "".join((c.get("function") or {}).get("arguments") or "" for c in calls if c["index"] == last)
    if not arguments:
        return "name"
    whole = arguments == json.dumps(t.calls[last].arguments)
    return "between_calls" if whole and last + 1 < len(t.calls) else "arguments"


def path_of(t: Transcript, where: str) -> str:
    """What the stream does: reasons only, or reasons then calls; broken before its calls, or inside them."""
    if not t.calls:
        return "reasoning"
    return "tool_call" if where in IN_CALLS else "both"


@dataclass(frozen=True)
class Wave:
    transcript: Transcript
    at: int  # tokens its stream is to have when the server ends


def places(reference: Streamed) -> tuple[int, int | None]:
    """The reference's token count, and how many tokens it had at its first call's name (None: it calls nothing)."""
    total, first = 0, None
    for choice in (c for chunk in reference.chunks for c in chunk.get("choices") or ()):
        total += len(choice.get("token_ids") or ())
        if first is None and (choice.get("delta") or {}).get("tool_calls"):
            first = total
    return total, first


def spread(low: int, high: int, count: int) -> list[int]:
    return [low + (high - low) * k // (count - 1) for k in range(count)]


def planned(references: dict[str, Streamed]) -> list[Wave]:
    """Reasoning-only chats over the middle half of their tokens; chats with calls over the later half of their
    reasoning and their answer (so the last waves start well before the end, and the spare has time to turn
    ready), and over the middle half of the tokens where their client has a call and the stream is AHEAD tokens
    or more from its finish, more streams where those are more (two calls' window is several times one call's, so
    where streams start a few tokens off, many of them are still inside at one moment); the farthest first."""
    places_of = {t.name: places(references[t.name]) for t in TRANSCRIPTS}
    inside = {name: (first, total - 1 - AHEAD) for name, (total, first) in places_of.items() if first is not None}
    widths = sum(last - first for first, last in inside.values())
    waves = []
    for t in TRANSCRIPTS:
        total, first = places_of[t.name]
        if first is None:
            waves += [Wave(t, n) for n in spread(total // 4, total * 3 // 4, BEFORE_CALLS)]
        else:
            last = inside[t.name][1]
            count = max(3, round(INSIDE_CALLS * (last - first) / widths))
            waves += [Wave(t, n) for n in spread(first // 2, first * 7 // 8, BEFORE_CALLS)]
            waves += [Wave(t, n) for n in spread((3 * first + last) // 4, (first + 3 * last) // 4, count)]
    return sorted(waves, key=lambda w: -w.at)


def tokens(streamed: Streamed) -> int:
    return sum(i is not None for i in token_ids(streamed))


async def reached(lead: Streamed, count: int) -> None:
    """Until the lead stream has ``count`` tokens (or has ended)."""
    async with asyncio.timeout(120):
        while tokens(lead) < count and not lead.ended:
            await asyncio.sleep(0.01)


def wave_user(name: str, n: int) -> str:
    """The ``user`` of ``in_waves``' ``n``-th stream under ``name``: what ties its continuations to it."""
    return f"{name}-{n}"


async def in_waves(gw: Running, waves: list[Wave], name: str, stack: AsyncExitStack) -> list[Streamed]:
    """``waves``' streams through the gateway, each started when the first (the lead, asking for its ids) is as far
    ahead as it is to be when the server ends; returns once all have started, the lead first. Leaving ``stack``
    waits for them all to end."""
    streams: list[Streamed] = []
    for n, wave in enumerate(waves):
        if streams:
            await reached(streams[0], waves[0].at - wave.at)
        call = request(wave.transcript, wave_user(name, n), asks_ids=not streams)
        (streamed,), _ = await stack.enter_async_context(through(gw, [call]))
        streams.append(streamed)
    return streams


def _first_token_at(streamed: Streamed) -> float | None:
    choices = ((chunk.get("choices") or [{}])[0] for chunk in streamed.chunks)
    return next(
        (at for c, at in zip(choices, streamed.arrivals, strict=True) if c and "role" not in c.get("delta", {})), None
    )


def best_end(waves: list[Wave], streams: list[Streamed], references: dict[str, Streamed]) -> tuple[int, int]:
    """The lead's token count, from the one it has now, at which to end the server, and how many streams will be
    inside their calls then (by AHEAD tokens before their finish): the middle of the first run of ends with the
    most, none finished. Each stream's lag behind the lead is measured, not planned: how many tokens the lead had
    when the stream's first one came (a new request reaches the engine some steps after its client sent it, more on
    a loaded machine, and seconds later on a server's first chats with tools)."""
    lead, clock = streams[0], [0]
    for chunk in lead.chunks:
        clock.append(clock[-1] + sum(len(c.get("token_ids") or ()) for c in chunk.get("choices") or ()))
    windows, lasts = [], []
    for wave, streamed in zip(waves, streams, strict=True):
        total, first = places(references[wave.transcript.name])
        started = _first_token_at(streamed)
        if started is not None:
            behind = clock[bisect_right(lead.arrivals, started)] - 1  # the lead's own: 0
            lasts.append(total - 1 - AHEAD + behind)
            windows += [(first + behind, total - 1 - AHEAD + behind)] if first is not None else []
    ends = range(clock[-1], max(min(lasts), clock[-1]) + 1)  # no stream finishes before the server ends
    inside = [sum(low <= end <= high for low, high in windows) for end in ends]
    best = [end for end, count in zip(ends, inside, strict=True) if count == max(inside)]
    run = [end for n, end in enumerate(best) if end - n == best[0]]  # the first run of consecutive ends
    return run[len(run) // 2], max(inside)
