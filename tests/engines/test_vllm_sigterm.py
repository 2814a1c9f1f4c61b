"""SIGTERM to a real vLLM with streams open, and the same to the fake engine: the same endings, frame for frame.

Last in the tier: the server it stops is started again for whatever runs after it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from simulate.fakes.engine import EngineConfig, serve_engine
from simulate.fakes.engine_shutdown import ERROR_EVENT
from simulate.fakes.processes import free_port, wait_http
from simulate.vllm.server import MODEL_NAME, VllmServer
from tests.conftest import until

QUIET_S = 3.0  # no byte for this long, no [DONE]: hung


@dataclass
class Ending:
    lines: list[bytes] = field(default_factory=list)
    eof: bool = False
    last_at: float = field(default_factory=time.monotonic)

    def kind(self) -> str:
        data = [line for line in self.lines if line.startswith(b"data: ")]
        if self.eof and data[-1:] == [b"data: [DONE]"] and data[-2:-1] == [ERROR_EVENT.strip()]:
            return "error"
        if self.eof and data[-1:] == [b"data: [DONE]"]:
            finish = json.loads(data[-2].removeprefix(b"data: "))["choices"][0]["finish_reason"]
            return "abort" if finish == "abort" else f"finished ({finish})"
        return "hang" if not self.eof and time.monotonic() - self.last_at >= QUIET_S else "unclear"

    def last_chunk(self) -> dict[str, object]:
        data = [line for line in self.lines if line.startswith(b"data: {")]
        chunk = json.loads(data[-1].removeprefix(b"data: "))
        assert isinstance(chunk, dict)
        return chunk


async def read(session: aiohttp.ClientSession, url: str, *, chat: bool, ending: Ending) -> None:
    body: dict[str, object] = {"model": MODEL_NAME, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "the stream"}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(url + path, json=body) as response:
        async for raw in response.content:
            if raw.strip():
                ending.lines.append(raw.strip())
                ending.last_at = time.monotonic()
    ending.eof = True


async def sigterm_with_streams_open(url: str, terminate: Callable[[], None]) -> list[Ending]:
    """A completion and a chat streaming, then ``terminate()``; returns once each has ended or gone quiet, its
    client closed (a hung stream's server waits for that)."""
    endings = [Ending(), Ending()]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [
            asyncio.create_task(read(session, url, chat=chat, ending=e))
            for chat, e in zip((False, True), endings, strict=True)
        ]
        await until(lambda: all(len(e.lines) >= 5 for e in endings), timeout_s=30)
        terminate()
        await until(lambda: all(e.kind() != "unclear" for e in endings), timeout_s=QUIET_S + 10)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return endings


def shape(chunk: dict[str, object]) -> dict[str, object]:
    """What a client reads of a last chunk, texts and ids and times aside."""
    choices = chunk["choices"]
    assert isinstance(choices, list)
    return {
        "keys": sorted(chunk),
        "object": chunk["object"],
        "choice": sorted(choices[0]),
        "finish_reason": choices[0]["finish_reason"],
    }


async def test_vllms_sigterm_ending_is_one_the_fake_engine_plays_frame_for_frame(
    vllm_servers: list[VllmServer],
) -> None:
    server = vllm_servers[-1]
    # SIGTERM to the API server alone, as the kubelet signals a container's first process.
    real = await sigterm_with_streams_open(server.url, lambda: os.kill(server.pid, signal.SIGTERM))
    kinds = {e.kind() for e in real}
    assert len(kinds) == 1, f"every stream of one server ends the same way: {kinds}"
    (kind,) = kinds
    print(f"vLLM ended its open streams on SIGTERM: {kind}")
    assert kind in ("abort", "error", "hang")
    exited = await asyncio.to_thread(_exited_within, server, 20.0)
    if not exited:
        server.kill()
    assert exited, "the server exits once its clients have gone"

    port, stop = free_port(), asyncio.Event()
    config = EngineConfig(model=MODEL_NAME, tokens_per_s=200, max_model_len=2048, sigterm_ending=kind)
    fake = asyncio.create_task(serve_engine(config, host="127.0.0.1", port=port, stop=stop))
    await wait_http(f"http://127.0.0.1:{port}/health")
    faked = await sigterm_with_streams_open(f"http://127.0.0.1:{port}", stop.set)
    await asyncio.wait_for(fake, 10)
    assert {e.kind() for e in faked} == {kind}
    if kind == "abort":
        assert [shape(e.last_chunk()) for e in faked] == [shape(e.last_chunk()) for e in real]


def _exited_within(server: VllmServer, timeout_s: float) -> bool:
    assert server.process is not None
    try:
        server.process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return True
