"""The gateway in front of real vLLM 0.32 serving chats that reason and call tools: a broken stream goes on exactly.

The thinking model (simulate/vllm/thinking_model.py) is served with ``--reasoning-parser deepseek_r1`` and with
``qwen3``, both with ``--enable-auto-tool-choice --tool-call-parser hermes``, and the gateway is told the same
(``--reasoning-parser``, ``--tool-call-parser``). Each transcript is streamed many times, each stream dropped by a
proxy right after a chosen token: in the thinking, on the ``</think>`` token, in the answer, in a call's name, in its
arguments, between two calls. Then a server is killed (SIGKILL), and another stopped (SIGTERM), under streams
started at once. The client's stream, assembled by the ``openai`` package's own stream helper
(``ChatCompletionStreamState``), must be the uninterrupted one's: reasoning, content and each call's index, name and
arguments equal byte for byte, a call begun before the cut keeps the id the client had (each call is named once),
one role, one finish reason, and the usage with its reasoning tokens.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

import tests.engines.cut_proxy as proxies
from simulate.fakes.processes import free_port
from simulate.fakes.sse_client import Streamed
from simulate.vllm.server import VllmServer, start_servers
from simulate.vllm.transcripts import TRANSCRIPTS, Transcript
from tests.engines.test_gateway_vllm import gather_streams, live, longest_silence, started, through, until
from tests.engines.test_reasoning_model import chat_body
from tests.gateway_harness import Running, gateway, metric, readiness

TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
CHAT = "/v1/chat/completions"
PER_TRANSCRIPT = 14  # cut points per transcript and parser, spread over its tokens, besides those at its markers
MARKER_TEXT = {"think_end": "</think>", "tool_start": "<tool_call>", "tool_end": "</tool_call>"}


@dataclass(frozen=True)
class Parsed:
    parser: str
    servers: list[VllmServer]

    def flags(self) -> tuple[str, ...]:
        return ("--reasoning-parser", self.parser, "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def parsed(thinking_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Parsed]]:
    """deepseek_r1 on three servers (one to kill, one to stop, one to continue on), qwen3 on one (the proxy's)."""
    model = thinking_vllm_model
    log_dir = tmp_path_factory.mktemp("parsed")
    servers = []
    try:
        for parser, count in (("deepseek_r1", 3), ("qwen3", 1)):
            args = ("--reasoning-parser", parser, *TOOLS)
            servers.append((parser, _started(count, model, log_dir / parser, args)))
        yield {parser: Parsed(parser, group) for parser, group in servers}
    finally:
        for _, group in servers:
            for server in group:
                server.stop()


def _started(count: int, model: Path, log_dir: Path, args: tuple[str, ...]) -> list[VllmServer]:
    log_dir.mkdir(parents=True, exist_ok=True)
    return start_servers([free_port() for _ in range(count)], model=model, log_dir=log_dir, extra_args=args)


def request(t: Transcript, name: str, *, asks_ids: bool = False) -> tuple[str, dict[str, Any]]:
    """The transcript's chat, told apart from its other streams by ``user`` (an OpenAI field vLLM passes by)."""
    body = chat_body(t, user=name, stream_options={"include_usage": True})
    return CHAT, body | {"return_token_ids": True} if asks_ids else body


def token_ids(streamed: Streamed) -> list[int | None]:
    """Every id the stream's chunks carry; None for a chunk without (the client did not ask)."""
    out: list[int | None] = []
    for choice in (c for chunk in streamed.chunks for c in chunk.get("choices") or () if "token_ids" in c):
        out += [None] if choice["token_ids"] is None else choice["token_ids"]
    return out


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


def without_new_ids(got: dict[str, Any], kept: set[int]) -> dict[str, Any]:
    calls = [c if c["index"] in kept else {**c, "id": None} for c in got.get("tool_calls") or ()]
    return {**got, "tool_calls": calls}


@dataclass(frozen=True)
class Cut:
    transcript: Transcript
    at: int  # tokens after which the stream is dropped
    where: str  # thinking, think_end, answer, call, between_calls

    @property
    def path(self) -> str:
        """What the stream does: reasons only, or reasons then calls; cut before its calls, or inside them."""
        if not self.transcript.calls:
            return "reasoning"
        return "tool_call" if self.where in ("call", "between_calls") else "both"


def cuts(t: Transcript, reference: Streamed, ids: dict[str, int]) -> list[Cut]:
    """Where to drop ``t``'s streams: after each chunk that ends at a marker, and at chunk ends spread evenly."""
    choices = [c for chunk in reference.chunks for c in chunk.get("choices") or () if c.get("token_ids")]
    tokens = [i for c in choices for i in c["token_ids"]]
    ends = list(accumulate(len(c["token_ids"]) for c in choices))[:-1]  # never after the finish
    end = tokens.index(ids["think_end"]) + 1
    starts = [n + 1 for n, i in enumerate(tokens) if i == ids["tool_start"]]
    closes = [n + 1 for n, i in enumerate(tokens) if i == ids["tool_end"]]

    def where(n: int) -> str:
        if n < end:
            return "thinking"
        if n == end:
            return "think_end"
        if not starts or n < starts[0]:
            return "answer"
        inside = any(s <= n < c for s, c in zip(starts, closes, strict=True))
        return "call" if inside or n >= closes[-1] else "between_calls"

    wanted = {end, end + 1, *(s + k for s in starts for k in (1, 3, 8)), *closes}
    wanted |= {ends[k * len(ends) // PER_TRANSCRIPT] for k in range(PER_TRANSCRIPT)}
    return [Cut(t, n, where(n)) for n in sorted(wanted) if n in ends and n >= 1]


async def marker_ids(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        out = {}
        for name, text in MARKER_TEXT.items():
            async with session.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}) as said:
                (out[name],) = (await said.json())["tokens"]
        return out


@asynccontextmanager
async def keyed_by_user(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    # The same chat is streamed many times here: the proxy tells them apart by ``user``. A continuation carries it
    # on: through the other proxy, which has the same cut, it is dropped again at the same token (a second break).
    monkeypatch.setattr(proxies, "key_of", lambda body: body.get("user") if isinstance(body, dict) else None)
    yield


def check(got: Streamed, want: Streamed, *, what: str) -> bool:
    """Whether the client's stream assembles to the uninterrupted one; asserts what must hold whatever the cut."""
    assert (got.status, got.done, got.errors) == (200, 1, []), (what, got.errors, got.body[:300])
    assert got.roles == ["assistant"], what
    assert len(got.finish_reasons) == 1, what
    assert named(got) == named(want), what  # every call named once: one begun before the cut kept its id
    mine, theirs = message(got), message(want)
    return without_new_ids(mine, set()) == without_new_ids(theirs, set())


def fractions(results: list[tuple[str, bool]]) -> dict[str, str]:
    paths = sorted({p for p, _ in results})
    return {p: f"{sum(ok for q, ok in results if q == p)}/{sum(q == p for q, _ in results)}" for p in paths}


async def cut_streams(gw: Running) -> float:
    return sum([await metric(gw, f'spotdrain_gateway_cuts_total{{reason="{r}"}}') for r in ("reasoning", "tool_call")])


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
async def test_parsed_streams_dropped_anywhere_continue_to_the_uninterrupted_message(
    parsed: dict[str, Parsed], parser: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = parsed[parser].servers[0]
    ids = await marker_ids(server.url)
    references = await gather_streams(server.url, [(CHAT, chat_body(t, return_token_ids=True)) for t in TRANSCRIPTS])
    planned = [c for t, r in zip(TRANSCRIPTS, references, strict=True) for c in cuts(t, r, ids)]
    calls = [request(c.transcript, f"{parser}-{n}", asks_ids=n % 3 == 0) for n, c in enumerate(planned)]
    want = await uninterrupted(server)
    reference_ids = {t.name: token_ids(r) for t, r in zip(TRANSCRIPTS, references, strict=True)}
    async with (
        keyed_by_user(monkeypatch),
        proxies.cut_proxy(server.url) as (first, first_port),
        proxies.cut_proxy(server.url) as (second, second_port),
    ):
        for (_, body), cut in zip(calls, planned, strict=True):
            first.cuts[body["user"]] = second.cuts[body["user"]] = cut.at
        async with gateway(first_port, second_port, flags=parsed[parser].flags()) as gw:
            got = await gather_streams(gw.url(""), calls)
            cut_count = await cut_streams(gw)
    results = [
        (c.path, check(g, want[c.transcript.name], what=f"{parser} {c.transcript.name} {c.where} {c.at}"))
        for c, g in zip(planned, got, strict=True)
    ]
    dropped = len(first.done) + len(second.done)
    print(
        f"{parser} dropped: {len(got)} streams, {dropped} dropped, equal assembled {fractions(results)}, "
        f"where {sorted({c.where for c in planned})}, longest silence {longest_silence(got):.2f} s"
    )
    assert cut_count == 0
    for n, (c, g) in enumerate(zip(planned, got, strict=True)):  # every third asked for the ids: each once, in order
        assert token_ids(g) == reference_ids[c.transcript.name] if n % 3 == 0 else set(token_ids(g)) <= {None}
    assert all(ok for _, ok in results), [
        (c.transcript.name, c.where, c.at) for c, (_, ok) in zip(planned, results, strict=True) if not ok
    ]
    for path in ("reasoning", "both", "tool_call"):
        assert sum(c.path == path for c in planned) >= 20, path


KILLED_STREAMS = 10  # per transcript, all started at once: the end finds each early in its reasoning


def killed_calls() -> tuple[list[Transcript], list[tuple[str, dict[str, Any]]]]:
    planned = [t for _ in range(KILLED_STREAMS) for t in TRANSCRIPTS]
    return planned, [request(t, f"ended-{n}") for n, t in enumerate(planned)]


def judged(planned: list[Transcript], streams: list[Streamed], want: dict[str, Streamed]) -> list[tuple[str, bool]]:
    """Each continued stream's path and whether it assembles to the uninterrupted message."""
    results = []
    for t, got in zip(planned, streams, strict=True):
        ok = check(got, want[t.name], what=f"ended {t.name}")
        if got.comments:  # continued: each splice is marked
            results.append(("both" if t.calls else "reasoning", ok))
    return results


async def uninterrupted(server: VllmServer) -> dict[str, Streamed]:
    wholes = await gather_streams(server.url, [request(t, "whole") for t in TRANSCRIPTS])
    return {t.name: w for t, w in zip(TRANSCRIPTS, wholes, strict=True)}


async def test_parsed_streams_on_a_killed_server_continue_to_the_uninterrupted_message(
    parsed: dict[str, Parsed],
) -> None:
    serving, spare = live(parsed["deepseek_r1"].servers, 2)
    want = await uninterrupted(spare)
    planned, calls = killed_calls()
    async with readiness(2) as (ready, urls):
        ready[1] = False  # every stream starts on the first server
        flags = ("--ready-url", urls[0], "--ready-url", urls[1], *parsed["deepseek_r1"].flags())
        async with gateway(serving.port, spare.port, flags=flags) as gw:
            await until(gw, "spotdrain_gateway_backends_ready", 1)
            async with through(gw, calls) as (streams, running):
                await started(streams, tokens=3)
                ready[1] = True
                await until(gw, "spotdrain_gateway_backends_ready", 2)
                serving.kill()  # SIGKILL of its process group, as a reclaimed node
                await running
            cut_count = await cut_streams(gw)
    results = judged(planned, streams, want)
    print(
        f"deepseek_r1 sigkill: {len(streams)} streams, {len(results)} continued, equal assembled {fractions(results)}, "
        f"longest silence {longest_silence(streams):.2f} s"
    )
    assert cut_count == 0
    assert all(ok for _, ok in results)
    assert sum(path == "reasoning" for path, _ in results) >= 20
    assert sum(path == "both" for path, _ in results) >= 20


async def test_parsed_streams_on_a_server_stopped_with_sigterm_continue_to_the_uninterrupted_message(
    parsed: dict[str, Parsed],
) -> None:
    """vLLM's SIGTERM endings (an abort chunk, an error event, a stream left open) under reasoning and tool-call
    streams: each continued on the spare, as tests/engines/test_gateway_vllm.py's plain ones are."""
    serving, spare = live(parsed["deepseek_r1"].servers, 2)
    want = await uninterrupted(spare)
    planned, calls = killed_calls()
    async with readiness(2) as (ready, urls):
        ready[1] = False
        flags = (
            "--ready-url",
            urls[0],
            "--ready-url",
            urls[1],
            "--migration-limit",
            "6",
            *parsed["deepseek_r1"].flags(),
        )
        async with gateway(serving.port, spare.port, flags=flags) as gw:
            await until(gw, "spotdrain_gateway_backends_ready", 1)
            async with through(gw, calls) as (streams, running):
                await started(streams, tokens=3)
                serving.signal(signal.SIGTERM)
                ready[1] = True
                await running
            cut_count = await cut_streams(gw)
        exited = await asyncio.to_thread(serving.process.wait, 60) if serving.process is not None else None
    results = judged(planned, streams, want)
    print(
        f"deepseek_r1 sigterm: {len(streams)} streams, {len(results)} continued, equal assembled "
        f"{fractions(results)}, longest silence {longest_silence(streams):.2f} s, server exited: {exited}"
    )
    assert cut_count == 0
    assert all(ok for _, ok in results)
    assert sum(path == "reasoning" for path, _ in results) >= 20
    assert sum(path == "both" for path, _ in results) >= 20
    assert exited is not None
