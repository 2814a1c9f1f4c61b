"""The fake vLLM from SIGTERM on, as vLLM 0.32.0 behaves (simulate/fakes/engine_shutdown.py has what was measured)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import pytest

from simulate.fakes.engine import EngineConfig, FakeEngine, serve_engine
from simulate.fakes.engine_shutdown import ENGINE_DEAD
from simulate.fakes.processes import free_port, wait_http
from tests.conftest import scrape, until


@dataclass
class Frames:
    lines: list[str] = field(default_factory=list)
    ended: bool = False  # the server ended the response (end of its chunked body)

    def data(self) -> list[str]:
        return [line.removeprefix("data: ") for line in self.lines if line.startswith("data: ")]


@dataclass
class Engine:
    port: int
    stop: asyncio.Event
    task: asyncio.Task[FakeEngine]
    readers: list[asyncio.Task[None]] = field(default_factory=list)

    def read(self, session: aiohttp.ClientSession, *, chat: bool, max_tokens: int) -> Frames:
        """Start reading one stream in the background; its frames arrive in what is returned."""
        frames = Frames()
        self.readers.append(
            asyncio.create_task(read(session, self.url, chat=chat, max_tokens=max_tokens, frames=frames))
        )
        return frames

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def engine(config: EngineConfig) -> AsyncIterator[Engine]:
    port, stop = free_port(), asyncio.Event()
    task = asyncio.create_task(serve_engine(config, host="127.0.0.1", port=port, stop=stop))
    running = Engine(port, stop, task)
    await wait_http(f"{running.url}/health", timeout_s=2)
    try:
        yield running
    finally:
        for reader in running.readers:
            reader.cancel()
        await asyncio.gather(*running.readers, return_exceptions=True)
        stop.set()
        await asyncio.wait_for(task, 10)


async def read(session: aiohttp.ClientSession, url: str, *, chat: bool, max_tokens: int, frames: Frames) -> None:
    body: dict[str, object] = {"max_tokens": max_tokens, "stream": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body) as response:
        async for raw in response.content:
            if raw.strip():
                frames.lines.append(raw.decode().strip())
    frames.ended = True


async def open_streams(session: aiohttp.ClientSession, fake: Engine, *, max_tokens: int) -> list[Frames]:
    """A completion and a chat streaming, once both have sent tokens."""
    frames = [fake.read(session, chat=chat, max_tokens=max_tokens) for chat in (False, True)]
    await until(lambda: all(len(f.data()) >= 3 for f in frames), timeout_s=5)
    return frames


async def test_abort_ends_every_open_stream_with_an_abort_chunk_then_done_and_the_port_closes() -> None:
    async with engine(EngineConfig(tokens_per_s=50, sigterm_ending="abort")) as fake, aiohttp.ClientSession() as s:
        frames = await open_streams(s, fake, max_tokens=1000)
        fake.stop.set()
        await until(lambda: all(f.ended for f in frames), timeout_s=2)
        for seen in frames:
            *_, last, done = seen.data()
            assert done == "[DONE]"
            assert json.loads(last)["choices"][0]["finish_reason"] == "abort"
        stopped = await asyncio.wait_for(fake.task, 2)
        assert stopped.cut == 2
        with pytest.raises(aiohttp.ClientConnectorError):
            await s.get(f"{fake.url}/health")


async def test_error_ends_every_open_stream_with_vllms_error_event_then_done() -> None:
    async with engine(EngineConfig(tokens_per_s=50, sigterm_ending="error")) as fake, aiohttp.ClientSession() as s:
        frames = await open_streams(s, fake, max_tokens=1000)
        fake.stop.set()
        await until(lambda: all(f.ended for f in frames), timeout_s=2)
        for seen in frames:
            assert seen.lines[-2:] == [
                'data: {"error": {"message": "' + ENGINE_DEAD + '", "type": "InternalServerError", "param": null, '
                '"code": 500}}',
                "data: [DONE]",
            ]


async def test_hang_sends_nothing_more_and_the_engine_exits_only_once_the_client_has_gone() -> None:
    async with engine(EngineConfig(tokens_per_s=50, sigterm_ending="hang")) as fake:
        async with aiohttp.ClientSession() as session:
            frames = await open_streams(session, fake, max_tokens=1000)
            fake.stop.set()
            await asyncio.sleep(0.1)
            counts = [len(f.lines) for f in frames]
            await asyncio.sleep(1.0)
            assert [len(f.lines) for f in frames] == counts, "not a byte more"
            assert not any(f.ended or "[DONE]" in f.lines for f in frames)
            assert not fake.task.done(), "the engine waits for its hung streams' clients"
        # The session is closed: the clients have gone.
        stopped = await asyncio.wait_for(fake.task, 2)
        assert stopped.cut == 2


async def test_under_a_shutdown_timeout_health_stays_up_new_requests_get_500_and_what_fits_finishes() -> None:
    config = EngineConfig(tokens_per_s=50, shutdown_timeout_s=1.0)
    async with engine(config) as fake, aiohttp.ClientSession() as s:
        short = fake.read(s, chat=False, max_tokens=30)  # 0.6 s
        long = fake.read(s, chat=True, max_tokens=1000)
        await until(lambda: len(short.data()) >= 2 and len(long.data()) >= 2)
        loop = asyncio.get_running_loop()
        fake.stop.set()
        stopped_at = loop.time()
        async with s.get(f"{fake.url}/health") as health:
            assert health.status == 200
        async with s.post(f"{fake.url}/v1/completions", json={"prompt": "x", "max_tokens": 5}) as refused:
            assert refused.status == 500
            assert await refused.text() == (
                '{"error":{"message":"cannot schedule new futures after shutdown","type":"InternalServerError",'
                '"param":null,"code":500}}'
            )
        await until(lambda: short.ended, timeout_s=2)
        assert short.data()[-1] == "[DONE]"
        assert json.loads(short.data()[-2])["choices"][0]["finish_reason"] == "length"
        await asyncio.sleep(1.2)
        count = len(long.lines)
        await asyncio.sleep(0.5)
        assert len(long.lines) == count, "past the timeout, the long stream hangs"
        assert not long.ended
        assert loop.time() - stopped_at > 1.0


async def test_under_a_shutdown_timeout_a_token_id_prompt_gets_a_200_with_nothing_generated() -> None:
    """What a gateway's continuation by ids meets on a draining vLLM 0.32.0 (measured): no 500, no token."""
    async with engine(EngineConfig(tokens_per_s=50, shutdown_timeout_s=2.0)) as fake, aiohttp.ClientSession() as s:
        long = fake.read(s, chat=False, max_tokens=1000)
        await until(lambda: len(long.data()) >= 2)
        fake.stop.set()
        await asyncio.sleep(0.05)
        url = f"{fake.url}/v1/completions"
        async with s.post(url, json={"prompt": [5, 6, 7], "max_tokens": 5, "stream": True}) as streamed:
            assert (streamed.status, await streamed.read()) == (200, b"data: [DONE]\n\n")
        body = {"prompt": [5, 6, 7], "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        async with s.post(url, json=body) as with_usage:
            usage, done = (await with_usage.read()).decode().split("\n\n")[:2]
        assert json.loads(usage.removeprefix("data: "))["usage"] == {
            "prompt_tokens": 3,
            "total_tokens": 3,
            "completion_tokens": 0,
        }
        assert done == "data: [DONE]"
        async with s.post(url, json={"prompt": [[5, 6, 7]], "max_tokens": 5}) as whole:
            answer = await whole.json()
        assert whole.status == 200
        assert (answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) == ("", "abort")
        assert answer["usage"]["completion_tokens"] == 0
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True}
        async with s.post(f"{fake.url}/v1/chat/completions", json=chat) as refused:
            assert refused.status == 500


async def test_the_gauges_count_a_request_only_from_its_first_token() -> None:
    # Its first token at 0.5 s: time enough for a scrape of the page on a busy machine.
    async with engine(EngineConfig(tokens_per_s=2)) as fake, aiohttp.ClientSession() as s:
        frames = fake.read(s, chat=False, max_tokens=2)
        await asyncio.sleep(0.1)  # sent, and far from its first token
        assert await scrape(f"{fake.url}/metrics", "vllm:num_requests_running") == 0
        assert await scrape(f"{fake.url}/metrics", "vllm:num_requests_waiting") == 0
        await until(lambda: len(frames.data()) >= 1)
        assert await scrape(f"{fake.url}/metrics", "vllm:num_requests_running") == 1
        await until(lambda: frames.ended)
        assert await scrape(f"{fake.url}/metrics", "vllm:num_requests_running") == 0
