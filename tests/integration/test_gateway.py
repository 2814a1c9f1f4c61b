"""The gateway against fake engines on 127.0.0.1: a broken stream is spliced into one that equals the reference."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from gateway.streaming import RETRY_PAUSES_S
from simulate.fakes.engine import EngineConfig
from simulate.fakes.kube import FakeKube
from simulate.fakes.processes import free_port
from simulate.fakes.sse_client import Streamed, read_stream
from spotdrain.clock import rfc3339, utcnow
from tests.conftest import scrape, serving_app
from tests.gateway_harness import (
    FAST_TOKENS_PER_S,
    Running,
    engines,
    gateway,
    metric,
    reference,
    running_engine_on,
)

COMPLETION = ("/v1/completions", {"prompt": "once upon a time", "max_tokens": 30})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 30})
USAGE = {"stream_options": {"include_usage": True}}


def faulty(fault: str, after: int = 7) -> EngineConfig:
    return EngineConfig(tokens_per_s=FAST_TOKENS_PER_S, fault=fault, fault_after=after)


HEALTHY = EngineConfig(tokens_per_s=FAST_TOKENS_PER_S)


def assert_spliced(got: Streamed, want: Streamed, *, chat: bool) -> None:
    """One stream, as a client would have had it from a single healthy engine."""
    assert got.status == 200
    assert got.text == want.text
    assert got.done == 1
    assert not got.cut
    assert got.errors == []
    assert got.finish_reasons == want.finish_reasons == ["length"]
    first = got.chunks[0]
    assert {(c["id"], c["created"], c["model"]) for c in got.chunks} == {
        (first["id"], first["created"], first["model"])
    }
    assert got.roles == (["assistant"] if chat else [])
    assert got.usage == want.usage


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("usage", [False, True], ids=["plain", "usage"])
async def test_a_stream_cut_by_a_dropped_connection_is_spliced_into_the_reference(
    path: str, body: dict[str, Any], usage: bool
) -> None:
    body = {**body, **(USAGE if usage else {})}
    want = await reference(path, body)
    async with engines(faulty("drop"), HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="continued"}') == 1
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="reset"}') == 1
        assert await metric(gw, "spotdrain_gateway_splice_gap_seconds_count") == 1
    assert_spliced(got, want, chat=path == CHAT[0])
    assert len(got.comments) == 1
    if usage:
        assert got.usage[0]["completion_tokens"] == 30


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
async def test_two_backend_deaths_in_one_stream_still_give_the_reference(path: str, body: dict[str, Any]) -> None:
    body = {**body, **USAGE}
    want = await reference(path, body)
    async with (
        engines(faulty("drop", 5), faulty("drop", 9), HEALTHY) as ports,
        gateway(*ports) as gw,
        aiohttp.ClientSession() as session,
    ):
        with capture_logs() as logs:
            got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="reset"}') == 2
    assert_spliced(got, want, chat=path == CHAT[0])
    assert len(got.comments) == 2
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    continued = [(e["backend"], e["to"], e["tokens_sent"]) for e in logs if e["event"] == "gateway.continued"]
    assert continued == [(urls[0], urls[1], 5), (urls[1], urls[2], 14)]


async def test_token_ids_returned_by_the_backend_make_the_continuation_prompt() -> None:
    body = {**COMPLETION[1], "return_token_ids": True, **USAGE}
    want = await reference(COMPLETION[0], body)
    async with engines(faulty("drop"), HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(COMPLETION[0]), body, session=session)
    assert_spliced(got, want, chat=False)
    ids = [i for c in got.chunks if c["choices"] for i in c["choices"][0]["token_ids"]]
    assert ids == [i for c in want.chunks if c["choices"] for i in c["choices"][0]["token_ids"]]


@pytest.mark.parametrize(
    ("fault", "cause"),
    [("abort", "abort"), ("error", "error_event"), ("garbage", "garbage"), ("hang", "timeout")],
)
async def test_every_abnormal_end_continues_on_another_backend(fault: str, cause: str) -> None:
    path, body = CHAT
    want = await reference(path, body)
    flags = ("--read-timeout", "0.5")
    async with (
        engines(faulty(fault), HEALTHY) as ports,
        gateway(*ports, flags=flags) as gw,
        aiohttp.ClientSession() as session,
    ):
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, f'spotdrain_gateway_continuations_total{{cause="{cause}"}}') == 1
        assert await metric(gw, f'spotdrain_gateway_backend_errors_total{{kind="{cause}"}}') == 1
    assert_spliced(got, want, chat=True)


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
async def test_a_backend_answering_503_before_the_stream_is_skipped_without_the_client_noticing(
    path: str, body: dict[str, Any]
) -> None:
    want = await reference(path, body)
    async with (
        engines(faulty("unavailable"), HEALTHY) as ports,
        gateway(*ports) as gw,
        aiohttp.ClientSession() as session,
    ):
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="server_error"}') == 1
    assert_spliced(got, want, chat=path == CHAT[0])
    assert got.comments == []  # nothing had reached the client: no splice to mark


async def test_a_backend_that_is_down_is_skipped() -> None:
    path, body = COMPLETION
    want = await reference(path, body)
    async with engines(HEALTHY) as ports, gateway(free_port(), *ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
    assert_spliced(got, want, chat=False)


@pytest.mark.parametrize(
    ("extra", "flags", "reason"),
    [
        ({"guided_json": {"type": "object"}}, (), "guided"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, (), "guided"),
        ({}, ("--migration-max-tokens", "3"), "too_long"),
        ({}, ("--migration-limit", "0"), "limit"),
    ],
)
async def test_a_stream_that_cannot_continue_ends_at_once_with_an_error_event(
    extra: dict[str, Any], flags: tuple[str, ...], reason: str
) -> None:
    path, body = CHAT
    async with (
        engines(faulty("drop"), HEALTHY) as ports,
        gateway(*ports, flags=flags) as gw,
        aiohttp.ClientSession() as session,
    ):
        got = await read_stream(gw.url(path), {**body, **extra}, session=session)
        assert await metric(gw, f'spotdrain_gateway_cuts_total{{reason="{reason}"}}') == 1
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="cut"}') == 1
    assert len(got.errors) == 1
    assert got.errors[0]["code"] == 503
    assert got.done == 1
    assert got.finish_reasons == []
    tokens = [c for c in got.chunks if c.get("choices") and "role" not in c["choices"][0]["delta"]]
    assert len(tokens) == 7  # the 7 the backend sent, empty-text ones included


async def test_no_ready_backend_gets_a_503_before_any_stream() -> None:
    async with gateway(free_port()) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(CHAT[0]), CHAT[1], session=session)
        async with session.get(gw.url("/health")) as health:
            assert health.status == 503
    assert got.status == 503


async def test_a_request_over_the_body_limit_gets_413() -> None:
    big = {"prompt": "x" * 2000, "max_tokens": 1, "stream": True}
    async with (
        engines(HEALTHY) as ports,
        gateway(*ports, flags=("--max-body-bytes", "1000")) as gw,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(gw.url("/v1/completions"), json=big) as response:
            assert response.status == 413
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="rejected"}') == 1


async def test_non_streamed_requests_models_and_health_pass_through() -> None:
    async with (
        engines(faulty("unavailable"), HEALTHY) as ports,
        gateway(*ports) as gw,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(gw.url("/v1/chat/completions"), json=CHAT[1]) as response:
            assert response.status == 200
            answer = await response.json()
        async with session.get(gw.url("/v1/models")) as models:
            assert (await models.json())["data"][0]["id"] == HEALTHY.model
        async with session.get(gw.url("/health")) as health:
            assert health.status == 200
    want = await reference(*CHAT)
    assert answer["choices"][0]["message"]["content"] == want.text


async def test_one_keep_alive_connection_takes_models_streams_and_whole_answers_in_turn() -> None:
    """As an OpenAI client's pooled connection is used: the gateway's own server serves every request on it."""
    connector = aiohttp.TCPConnector(limit=1)
    async with engines(HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession(connector=connector) as session:
        async with session.get(gw.url("/v1/models")) as models:
            assert (await models.json())["data"][0]["id"] == HEALTHY.model
        first = await read_stream(gw.url(COMPLETION[0]), COMPLETION[1], session=session)
        async with session.post(gw.url("/v1/chat/completions"), json=CHAT[1]) as whole:
            answer = await whole.json()
        second = await read_stream(gw.url(CHAT[0]), CHAT[1], session=session)
        async with session.get(gw.url("/nowhere")) as missing, session.get(gw.url(CHAT[0])) as wrong:
            assert missing.status == 404
            assert wrong.status == 405
            assert wrong.headers["Allow"] == "POST"
        opened = await metric(gw, "spotdrain_gateway_open_streams")
    assert first.text == (await reference(*COMPLETION)).text
    assert second.text == answer["choices"][0]["message"]["content"] == (await reference(*CHAT)).text
    assert first.done == second.done == 1
    assert opened == 0


async def test_an_http_1_0_client_gets_the_stream_unframed_until_the_close() -> None:
    async with engines(HEALTHY) as ports, gateway(*ports) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        body = json.dumps({**COMPLETION[1], "stream": True}).encode()
        writer.write(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    head, _, events = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding" not in head
    datas = [line[6:] for line in events.split(b"\n") if line.startswith(b"data: ")]
    assert datas[-1] == b"[DONE]"
    text = "".join(json.loads(d)["choices"][0]["text"] for d in datas[:-1])
    assert text == (await reference(*COMPLETION)).text


async def test_a_backend_refusal_reaches_the_client_as_it_is() -> None:
    async with engines(HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url("/v1/completions"), {"prompt": "x", "max_tokens": 0}, session=session)
    assert got.status == 400


async def test_headers_pass_through_both_ways() -> None:
    seen: list[str | None] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"object": "list", "data": []}, headers={"X-Request-Id": "abc", "X-Name": "caf\u20ac"})

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/v1/models", echo)
    app.router.add_get("/health", health)
    async with (
        serving_app(app) as port,
        gateway(port) as gw,
        aiohttp.ClientSession() as session,
        session.get(gw.url("/v1/models"), headers={"Authorization": "Bearer k"}) as response,
    ):
        assert response.headers["X-Request-Id"] == "abc"
        assert response.headers["X-Name"] == "caf\u20ac"  # not latin-1: as the backend's UTF-8 bytes
    assert seen == ["Bearer k"]


async def test_a_client_that_leaves_closes_the_backend_stream() -> None:
    path, body = COMPLETION
    async with (
        engines(EngineConfig(tokens_per_s=50)) as ports,
        gateway(*ports) as gw,
        aiohttp.ClientSession() as session,
    ):
        task = asyncio.create_task(read_stream(gw.url(path), {**body, "max_tokens": 500}, session=session))
        await asyncio.sleep(0.3)
        task.cancel()
        for _ in range(100):
            if await metric(gw, 'spotdrain_gateway_requests_total{outcome="abandoned"}') == 1:
                break
            await asyncio.sleep(0.05)
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="abandoned"}') == 1
        assert await metric(gw, "spotdrain_gateway_open_streams") == 0


async def test_a_backend_that_accepts_and_never_answers_times_out_and_the_stream_moves_on() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        await asyncio.sleep(30)  # never answers; the gateway's read timeout ends this first
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    silent_port = server.sockets[0].getsockname()[1]
    path, body = COMPLETION
    want = await reference(path, body)
    try:
        async with (
            engines(HEALTHY) as ports,
            gateway(silent_port, *ports, flags=("--read-timeout", "0.3", "--health-interval", "60")) as gw,
            aiohttp.ClientSession() as session,
        ):
            got = await read_stream(gw.url(path), body, session=session)
            assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="timeout"}') == 1
    finally:
        server.close()
    assert_spliced(got, want, chat=False)


async def test_a_backend_that_comes_back_after_a_restart_takes_requests_again() -> None:
    port = free_port()
    async with gateway(port) as gw, aiohttp.ClientSession() as session:
        first = await read_stream(gw.url(COMPLETION[0]), COMPLETION[1], session=session)
        assert first.status == 503
        async with running_engine_on(port):
            for _ in range(100):
                async with session.get(gw.url("/health")) as health:
                    if health.status == 200:
                        break
                await asyncio.sleep(0.05)
            again = await read_stream(gw.url(COMPLETION[0]), COMPLETION[1], session=session)
    assert again.status == 200
    assert again.text == (await reference(*COMPLETION)).text


async def test_a_request_body_that_never_arrives_gets_408_after_the_read_timeout() -> None:
    async with engines(HEALTHY) as ports, gateway(*ports, flags=("--read-timeout", "0.3")) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status.startswith(b"HTTP/1.1 408")
        assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="abandoned"}') == 1


async def test_a_backend_whose_ready_url_fails_gets_no_new_stream_as_a_draining_pod_would() -> None:
    serving = [True]

    async def ready(_: web.Request) -> web.Response:
        return web.Response(status=200 if serving[0] else 503)

    app = web.Application()
    app.router.add_get("/ready", ready)
    async with serving_app(app) as sidecar_port, engines(HEALTHY, HEALTHY) as (first, second):
        flags: tuple[str, ...] = ("--ready-url", f"http://127.0.0.1:{sidecar_port}/ready")
        flags += ("--ready-url", f"http://127.0.0.1:{second}/health")
        async with gateway(first, second, flags=flags) as gw, aiohttp.ClientSession() as session:
            serving[0] = False  # the first pod's sidecar starts draining
            for _ in range(100):
                if await metric(gw, "spotdrain_gateway_backends_ready") == 1:
                    break
                await asyncio.sleep(0.05)
            before = await scrape(f"http://127.0.0.1:{first}/metrics", "vllm:generation_tokens_total")
            got = await asyncio.gather(
                *(read_stream(gw.url(path), body, session=session) for path, body in [COMPLETION] * 4)
            )
            after = await scrape(f"http://127.0.0.1:{first}/metrics", "vllm:generation_tokens_total")
    assert [g.done for g in got] == [1] * 4
    assert after == before


async def test_the_only_backend_failing_before_the_stream_gets_the_same_request_again_after_a_pause() -> None:
    answers: list[float] = []
    loop = asyncio.get_running_loop()

    bodies: list[Any] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        answers.append(loop.time())
        bodies.append(await request.json())
        if len(answers) == 1:  # a Service whose endpoints still hold a dead pod
            return web.Response(status=502, text="upstream unreachable")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
        chunk["choices"] = [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}]
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    async with serving_app(app) as port, gateway(port) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url("/v1/completions"), {"prompt": "x"}, session=session)
    assert (got.text, got.done) == (" ok", 1)
    assert answers[1] - answers[0] >= RETRY_PAUSES_S[0]
    assert bodies[1] == bodies[0]  # nothing was generated yet: the request itself, not a continuation


async def test_with_a_service_the_backends_are_its_ready_endpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with FakeKube() as kube, engines(HEALTHY, HEALTHY) as (first, second):
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")
        kube.set_endpoints("ml", "vllm", [("127.0.0.1", first, True), ("127.0.0.1", second, True)])
        # Health checks and the old polling every 60 s: only a watch brings the readiness flip in time.
        flags: tuple[str, ...] = ("--service", "ml/vllm", "--serviceaccount-dir", str(account))
        flags = (*flags, "--service-port", "http", "--health-interval", "60")
        async with gateway(flags=flags) as gw, aiohttp.ClientSession() as session:
            await until_metric(gw, "spotdrain_gateway_backends_ready", 2)
            want = await reference(*COMPLETION)
            assert (await read_stream(gw.url(COMPLETION[0]), COMPLETION[1], session=session)).text == want.text
            # The first pod's sidecar starts draining: its endpoint turns not ready.
            kube.set_endpoints("ml", "vllm", [("127.0.0.1", first, False), ("127.0.0.1", second, True)])
            await until_metric(gw, "spotdrain_gateway_backends_ready", 1)
            before = await scrape(f"http://127.0.0.1:{first}/metrics", "vllm:generation_tokens_total")
            calls = [read_stream(gw.url(COMPLETION[0]), COMPLETION[1], session=session) for _ in range(4)]
            got = await asyncio.gather(*calls)
            after = await scrape(f"http://127.0.0.1:{first}/metrics", "vllm:generation_tokens_total")
    assert [g.text for g in got] == [want.text] * 4
    assert after == before


async def until_metric(gw: Running, sample: str, value: float) -> None:
    async with asyncio.timeout(10):
        while await metric(gw, sample) != value:
            await asyncio.sleep(0.05)


async def test_a_stream_moves_off_a_backend_before_its_nodes_termination_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = EngineConfig(tokens_per_s=100)
    path, body = CHAT[0], {**CHAT[1], "max_tokens": 150, **USAGE}
    want = await reference(path, body)
    async with FakeKube() as kube, engines(slow, slow) as (first, second):
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        kube.add_node("gpu-1")
        kube.add_node("gpu-2")
        account = kube.serviceaccount_dir(tmp_path / "sa", namespace="ml")
        nodes = ("gpu-1", "gpu-2")
        kube.set_endpoints("ml", "vllm", [("127.0.0.1", first, True), ("127.0.0.1", second, False)], nodes=nodes)
        flags: tuple[str, ...] = ("--service", "ml/vllm", "--serviceaccount-dir", str(account))
        # The annotation must come through the node's watch: nothing is polled within 60 s.
        flags = (*flags, "--migration-margin", "10", "--health-interval", "60")
        async with gateway(flags=flags) as gw, aiohttp.ClientSession() as session:
            await until_metric(gw, "spotdrain_gateway_backends_ready", 1)
            running = asyncio.create_task(read_stream(gw.url(path), body, session=session))
            await until_metric(gw, "spotdrain_gateway_open_streams", 1)
            await asyncio.sleep(0.3)  # tokens flow from the first pod
            kube.set_endpoints("ml", "vllm", [("127.0.0.1", first, True), ("127.0.0.1", second, True)], nodes=nodes)
            kube.annotate_node("gpu-1", {"spotdrain.io/termination-time": rfc3339(utcnow() + timedelta(seconds=5))})
            got = await running
            assert await metric(gw, 'spotdrain_gateway_continuations_total{cause="proactive"}') == 1
            assert await metric(gw, 'spotdrain_gateway_requests_total{outcome="continued"}') == 1
    assert_spliced(got, want, chat=True)


SAMPLED_N = {"n": 2, "temperature": 1.0, **USAGE}


@pytest.mark.parametrize(("path", "body"), [COMPLETION, CHAT], ids=["completions", "chat"])
async def test_several_choices_are_relayed_as_the_engine_sends_them(path: str, body: dict[str, Any]) -> None:
    body = {**body, **SAMPLED_N}
    want = await reference(path, body)
    async with engines(HEALTHY) as ports, gateway(*ports) as gw, aiohttp.ClientSession() as session:
        got = await read_stream(gw.url(path), body, session=session)
    assert [c["choices"] for c in got.chunks] == [c["choices"] for c in want.chunks]
    assert {c["choices"][0]["index"] for c in got.chunks if c["choices"]} == {0, 1}
    assert got.finish_reasons == ["length", "length"]
    assert got.usage == want.usage
    assert got.done == 1


async def test_a_broken_stream_of_several_choices_is_cut_not_continued() -> None:
    path, body = COMPLETION[0], {**COMPLETION[1], **SAMPLED_N}
    async with (
        engines(faulty("drop"), HEALTHY) as ports,
        gateway(*ports) as gw,
        aiohttp.ClientSession() as session,
    ):
        got = await read_stream(gw.url(path), body, session=session)
        assert await metric(gw, 'spotdrain_gateway_cuts_total{reason="multiple_choices"}') == 1
    assert {c["choices"][0]["index"] for c in got.chunks if c.get("choices")} == {0, 1}
    assert len(got.errors) == 1
    assert (got.done, got.finish_reasons) == (1, [])
