"""The gateway continues by token ids it asks for itself, and moves streams stalled on backends that are going away.

Against fake engines on 127.0.0.1 that stream partial characters as empty-text chunks and echo a token-id prompt
that ends inside a character, as vLLM 0.32.0 does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from gateway.backends import Backend, context_length
from simulate.fakes.engine import EngineConfig, FakeEngine, serve_engine
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port, wait_http
from simulate.fakes.sse_client import Streamed, read_stream
from simulate.fakes.tokens import Detokenizer
from tests.conftest import serving_app
from tests.gateway_harness import FAST_TOKENS_PER_S, engines, gateway, metric, readiness, reference

COMPLETION = ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 40})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 40})
USAGE = {"stream_options": {"include_usage": True}}
HEALTHY = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S)


def assert_same(got: Streamed, want: Streamed) -> None:
    """What the client got is the uninterrupted stream: text, ids (where asked), finish, usage, one [DONE]."""
    assert (got.status, got.done, got.cut, got.errors) == (200, 1, False, [])
    assert got.text == want.text
    assert got.finish_reasons == want.finish_reasons
    assert got.usage == want.usage
    assert token_ids(got) == token_ids(want)


def token_ids(streamed: Streamed) -> list[int]:
    return [i for c in streamed.chunks for choice in c.get("choices") or () for i in choice.get("token_ids") or ()]


def empty_text_cuts(want: Streamed, *, chat: bool) -> list[int]:
    """Token counts after which the reference had just streamed an empty-text chunk."""
    chunks = [c for c in want.chunks if c.get("choices")][1 if chat else 0 :]
    texts = [c["choices"][0].get("text", (c["choices"][0].get("delta") or {}).get("content")) for c in chunks]
    return [index + 1 for index, text in enumerate(texts) if text == ""]


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
async def test_the_gateway_asks_for_token_ids_and_the_client_that_did_not_sees_vllms_nulls(
    path: str, body: dict[str, Any]
) -> None:
    body = {**body, **USAGE}
    want = await reference(path, body)
    async with engines(HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
    # Field for field what the engine sends a client that did not ask (ids and times are the engine's own).
    assert [c["choices"] for c in got.chunks] == [c["choices"] for c in want.chunks]
    assert [sorted(c) for c in got.chunks] == [sorted(c) for c in want.chunks]
    token_chunks = [c for c in got.chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]
    assert {c["choices"][0]["token_ids"] for c in token_chunks} == {None}
    if path == CHAT[0]:
        assert got.chunks[0]["prompt_token_ids"] is None
    else:
        assert got.chunks[0]["choices"][0]["prompt_token_ids"] is None


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("asked", [False, True], ids=["own-ids", "client-ids"])
async def test_a_stream_cut_after_an_empty_text_token_continues_exactly_by_ids(
    path: str, body: dict[str, Any], asked: bool
) -> None:
    chat = path == CHAT[0]
    body = {**body, **USAGE, **({"return_token_ids": True} if asked else {})}
    want = await reference(path, {**body, "return_token_ids": True})
    cut = empty_text_cuts(want, chat=chat)[0]
    if not asked:
        want = await reference(path, body)
    faulty = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S, fault="drop", fault_after=cut)
    async with engines(faulty, HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="token_ids"}') == 1
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="text"}') == 0
    assert_same(got, want)
    assert got.usage[0]["completion_tokens"] == 40
    assert {c["object"] for c in got.chunks} == {"chat.completion.chunk" if chat else "text_completion"}


def merged_cuts(want: Streamed) -> list[int]:
    """Token counts after which the reference had just streamed a chunk of several tokens with text whose last token
    starts a character the text leaves out (a text that ends with a whole character says nothing of it)."""
    ends, count = [], 0
    for chunk in want.chunks:
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or []
            count += len(ids)
            text = choice.get("text", (choice.get("delta") or {}).get("content"))
            if len(ids) > 1 and text and Detokenizer().step(ids[-1]) == "":
                ends.append(count)
    return ends


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
async def test_a_stream_cut_after_a_merged_chunk_ending_inside_a_character_continues_exactly(
    path: str, body: dict[str, Any]
) -> None:
    """A loaded vLLM sends several steps in one chunk; its last token can hold a character's first byte."""
    body = {**body, **USAGE, "max_tokens": 120}
    merged = dataclasses.replace(HEALTHY, merge_steps=3)
    cuts = merged_cuts(await reference(path, {**body, "return_token_ids": True}, merge_steps=3))
    assert cuts
    want = await reference(path, body)
    faulty = dataclasses.replace(merged, fault="drop", fault_after=cuts[0])
    async with engines(faulty, merged) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="token_ids"}') == 1
    assert got.text == want.text
    assert (got.usage, got.finish_reasons, got.done, got.errors) == (want.usage, want.finish_reasons, 1, [])


async def test_a_chat_without_a_token_limit_continues_to_the_end_of_the_models_context() -> None:
    path, body = CHAT[0], {"messages": CHAT[1]["messages"], **USAGE}
    small = EngineConfig(tokens_per_s=2000, max_model_len=80)
    faulty = EngineConfig(tokens_per_s=2000, max_model_len=80, fault="drop", fault_after=20)
    async with engines(small) as (alone,), aiohttp.ClientSession() as session:
        want = await read_stream(f"http://127.0.0.1:{alone}{path}", body, session=session)
    async with engines(faulty, small) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="token_ids"}') == 1
    assert_same(got, want)
    assert want.usage[0]["total_tokens"] == 80


def words_only(*, token_ids: str) -> tuple[EngineConfig, EngineConfig]:
    """A words-only engine answering ``return_token_ids`` that way, and the same one dropping streams at 7 tokens."""
    words = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S, partial_utf8=False, token_ids=token_ids)
    return words, dataclasses.replace(words, fault="drop", fault_after=7)


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
async def test_a_backend_that_refuses_the_field_is_asked_without_it_and_continued_by_text(
    path: str, body: dict[str, Any]
) -> None:
    """Text continues exactly only on a tokenizer that round-trips: the words-only model here."""
    body = {**body, **USAGE}
    words, cut = words_only(token_ids="refused")
    async with engines(words) as (alone,), aiohttp.ClientSession() as session:
        want = await read_stream(f"http://127.0.0.1:{alone}{path}", body, session=session)
    async with engines(cut, words) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        with capture_logs() as logs:
            got = await read_stream(gw.url(path), body, session=session)
            again = await read_stream(gw.url(path), body, session=session)
        continued = await metric(gw, 'spotdrain_gateway_requests_total{outcome="continued"}')
        assert continued >= 1
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="text"}') == continued
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="token_ids"}') == 0
    assert_same(got, want)
    assert_same(again, want)
    refused = [e["backend"] for e in logs if e["event"] == "backend.no_token_ids"]
    assert len(refused) == len(set(refused)) >= 1  # once per backend it was asked of, then remembered


async def test_a_backend_that_ignores_the_field_is_continued_by_text_and_counted_so() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    words, cut = words_only(token_ids="ignored")
    async with engines(words) as (alone,), aiohttp.ClientSession() as session:
        want = await read_stream(f"http://127.0.0.1:{alone}{path}", body, session=session)
    async with engines(cut, words) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_continuation_methods_total{method="text"}') == 1
    assert_same(got, want)


@asynccontextmanager
async def hanging_engine(
    *, tokens_per_s: float = FAST_TOKENS_PER_S, fault_after: int = 7
) -> AsyncIterator[tuple[int, web.TCPSite]]:
    """A fake engine whose streams hang after ``fault_after`` tokens; stopping its site refuses new connections and
    keeps the open ones open, as vLLM does on SIGTERM when it hangs (vLLM 0.32.0, measured)."""
    engine = FakeEngine(EngineConfig(tokens_per_s=tokens_per_s, fault="hang", fault_after=fault_after))
    runner = web.AppRunner(engine.app(), handle_signals=False, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield port, site
    finally:
        await runner.cleanup()


async def _hung(gw_url: str, body: dict[str, Any], session: aiohttp.ClientSession) -> asyncio.Task[Streamed]:
    """A stream started and hung: its first chunks have come, then nothing."""
    running = asyncio.create_task(read_stream(gw_url, body, session=session))
    await asyncio.sleep(0.5)
    assert not running.done()
    return running


async def test_a_stream_hung_on_a_backend_that_refuses_connections_continues_within_the_stall_bound() -> None:
    path, body = CHAT[0], {**CHAT[1], **USAGE}
    want = await reference(path, body)
    # No health check in time to notice: the stall's own probe must.
    flags = ("--health-interval", "60")
    async with (
        hanging_engine() as (hung, site),
        engines(HEALTHY) as (healthy,),
        gateway(hung, healthy, flags=flags) as gw,
        aiohttp.ClientSession() as session,
    ):
        running = await _hung(gw.url(path), body, session)
        await site.stop()  # the server goes: no new connection, the open stream stays open and silent
        stopped = time.monotonic()
        got = await running
        waited = time.monotonic() - stopped
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="stalled"}') == 1
    assert_same(got, want)
    assert waited < 3.0  # the stall bound (2 s at most) and a probe, not the 60 s read timeout


async def test_a_stream_hung_on_a_draining_backend_continues_within_the_stall_bound() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    want = await reference(path, body)
    async with (
        hanging_engine() as (hung, _),
        engines(HEALTHY) as (healthy,),
        readiness(1) as (ready, (sidecar,)),
    ):
        flags = (
            "--ready-url",
            sidecar,
            "--ready-url",
            f"http://127.0.0.1:{healthy}/health",
        )
        async with gateway(hung, healthy, flags=flags) as gw, aiohttp.ClientSession() as session:
            running = await _hung(gw.url(path), body, session)
            ready[0] = False  # its sidecar started draining: out of rotation
            started = time.monotonic()
            got = await running
            waited = time.monotonic() - started
            assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="stalled"}') == 1
    assert_same(got, want)
    assert waited < 3.0


async def test_a_silent_stream_on_a_backend_in_rotation_waits_for_the_read_timeout() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    want = await reference(path, body)
    async with (
        hanging_engine() as (hung, _),
        engines(HEALTHY) as (healthy,),
        gateway(hung, healthy, flags=("--read-timeout", "3.5")) as gw,
        aiohttp.ClientSession() as session,
    ):
        running = await _hung(gw.url(path), body, session)
        started = time.monotonic()
        got = await running
        waited = time.monotonic() - started
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="timeout"}') == 1
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="stalled"}') == 0
    assert_same(got, want)
    assert waited > 2.5  # probed (it accepts connections) and left alone: a prefill can be this silent


async def test_a_stream_hung_on_an_endpoint_that_turned_not_ready_continues_within_the_stall_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, body = CHAT[0], {**CHAT[1], **USAGE}
    want = await reference(path, body)
    async with FakeKube() as kube, hanging_engine() as (hung, _), engines(HEALTHY) as (healthy,):
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")
        kube.set_endpoints("ml", "vllm", [("127.0.0.1", hung, True), ("127.0.0.1", healthy, False)])
        flags = ("--service", "ml/vllm", "--serviceaccount-dir", str(account), "--health-interval", "60")
        async with gateway(flags=flags) as gw, aiohttp.ClientSession() as session:
            running = await _hung(gw.url(path), body, session)
            kube.set_endpoints("ml", "vllm", [("127.0.0.1", hung, False), ("127.0.0.1", healthy, True)])
            started = time.monotonic()
            got = await running
            waited = time.monotonic() - started
            assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="stalled"}') == 1
    assert_same(got, want)
    assert waited < 3.0


HOW = web.AppKey("how", str)


async def _models_answer(request: web.Request) -> web.StreamResponse:
    """``/v1/models`` as a backend at its worst: hung, dropped mid-answer, garbage with a 200, or vLLM's card."""
    how = request.app[HOW]
    if how == "hang":
        await asyncio.sleep(3)  # well past the caller's timeout, short enough for the server's own shutdown
    if how == "drop":
        response = web.StreamResponse(headers={"Content-Length": "100"})
        await response.prepare(request)
        await response.write(b'{"data": [')
        assert request.transport is not None
        request.transport.abort()
        return response
    if how == "garbage":
        return web.Response(body=b"<html>\x00\xff not json", content_type="application/json")
    return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 2048}]})


@pytest.mark.parametrize(("how", "expected"), [("hang", None), ("drop", None), ("garbage", None), ("card", 2048)])
async def test_the_context_length_survives_a_backend_that_hangs_drops_or_answers_garbage(
    how: str, expected: int | None
) -> None:
    app = web.Application()
    app[HOW] = how
    app.router.add_get("/v1/models", _models_answer)
    async with serving_app(app) as port, aiohttp.ClientSession() as session:
        backend = Backend(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/health")
        started = time.monotonic()
        length = await context_length(session, backend, model="tiny", timeout_s=0.5)
        assert time.monotonic() - started < 2
        assert length == expected
        assert backend.context_len == expected  # only a real answer is kept; a failure is asked again next time


async def test_a_broken_stream_with_only_its_own_backend_ready_looks_again_for_another_at_once() -> None:
    """The spare turned ready since the last health check (it took the place of a server that now stops): the
    continuation goes there rather than back to the server that failed it, without waiting for the next check."""
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE}
    want = await reference(path, body)
    failing = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S, fault="error", fault_after=5)
    async with engines(failing, HEALTHY) as (first, spare), readiness(1) as (ready, (spare_url,)):
        ready[0] = False
        flags = ("--ready-url", f"http://127.0.0.1:{first}/health", "--ready-url", spare_url)
        async with gateway(first, spare, flags=(*flags, "--health-interval", "60")) as gw:
            async with asyncio.timeout(10):
                while await metric(gw, "spotdrain_gateway_backends_ready") != 1:
                    await asyncio.sleep(0.05)
            ready[0] = True  # not seen before the next check, 60 s away
            started = time.monotonic()
            async with aiohttp.ClientSession() as session:
                got = await read_stream(gw.url(path), body, session=session)
            took = time.monotonic() - started
            assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="error_event"}') == 1
            assert await metric(gw, "spotdrain_gateway_backends_ready") == 2
    assert_same(got, want)
    assert took < 5.0  # 40 tokens at the fake's pace, one continuation, no pause for a health interval


async def test_a_continuation_answered_with_nothing_by_a_draining_engine_goes_on_elsewhere() -> None:
    """Under --shutdown-timeout vLLM answers a token-id prompt 200 with only [DONE]: not an end for the client."""
    path, body = COMPLETION[0], {**COMPLETION[1], **USAGE, "max_tokens": 12}
    want = await reference(path, body)
    failing = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S, fault="drop", fault_after=7)
    stop, port = asyncio.Event(), free_port()
    config = EngineConfig(tokens_per_s=20, shutdown_timeout_s=30.0)
    draining = asyncio.create_task(serve_engine(config, host="127.0.0.1", port=port, stop=stop))
    async with engines(failing) as (first,), aiohttp.ClientSession() as session:
        await wait_http(f"http://127.0.0.1:{port}/health")
        held = asyncio.create_task(
            read_stream(f"http://127.0.0.1:{port}{path}", {**body, "max_tokens": 1000}, session=session)
        )
        await asyncio.sleep(0.3)
        stop.set()  # SIGTERM: it drains the held stream, /health stays 200
        async with gateway(first, port, flags=("--migration-limit", "4")) as gw:
            got = await read_stream(gw.url(path), body, session=session)
            assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="reset"}') >= 1
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
    await asyncio.wait_for(draining, 10)
    assert_same(got, want)
