"""The fake engine answers as real vLLM does: the same requests to both, their frames compared field by field.

Texts differ (the fake has its own tokenizer and model); everything our code or a client reads must not: each
frame's fields and their types, ``object``, the id's prefix, finish and stop reasons, usage, error bodies, the
``[DONE]`` that ends a stream, and the ``/metrics`` families the sidecar and the dashboards use.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from simulate.fakes.engine import EngineConfig
from simulate.vllm.server import MODEL_NAME, VllmServer
from tests.conftest import running_engine

Frame = dict[str, Any] | str


@pytest.fixture
async def fake_url() -> AsyncIterator[str]:
    async with running_engine(EngineConfig(model=MODEL_NAME, tokens_per_s=2000.0, max_model_len=2048)) as port:
        yield f"http://127.0.0.1:{port}"


Answer = tuple[int, list[Frame] | dict[str, Any]]


async def _call(url: str, path: str, body: dict[str, Any]) -> Answer:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(url + path, json=body) as response:
        if not body.get("stream") or response.status != 200:
            return response.status, await response.json(content_type=None)
        frames: list[Frame] = []
        async for line in response.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                frames.append("[DONE]" if data == b"[DONE]" else json.loads(data))
        return response.status, frames


def shape(value: Any) -> Any:
    """A value's structure: field names and JSON types, with the fields that carry meaning kept as values."""
    if isinstance(value, dict):
        return {key: _field(key, item) for key, item in value.items()}
    if isinstance(value, list):
        return sorted({json.dumps(shape(item), sort_keys=True) for item in value})
    return type(value).__name__


KEPT = ("object", "finish_reason", "role", "type", "code", "param", "index")


def _field(key: str, value: Any) -> Any:
    if key in KEPT:
        return value
    if key == "id" and isinstance(value, str):
        return value.split("-")[0] + "-"
    if key == "stop_reason":
        return "null" if value is None else type(value).__name__
    return shape(value)


def kind(frame: Frame, *, chat: bool) -> str:
    """Which of a stream's kinds of frame this is: each kind must look the same on both engines."""
    if frame == "[DONE]":
        return "done"
    assert isinstance(frame, dict)
    if "error" in frame:
        return "error"
    choices = frame.get("choices") or []
    if not choices:
        return "usage"
    choice = choices[0]
    if chat and "role" in (choice.get("delta") or {}):
        return "role"
    if choice.get("finish_reason") is not None:
        return "last"
    if choice.get("prompt_token_ids") is not None:  # a choice's first token, whatever its text
        return "first"
    text = choice["delta"].get("content") if chat else choice.get("text")
    return "token" if text else "empty-token"


def stream_shapes(frames: list[Frame], *, chat: bool) -> dict[str, list[str]]:
    by_kind: dict[str, set[str]] = {}
    for frame in frames:
        by_kind.setdefault(kind(frame, chat=chat), set()).add(json.dumps(shape(frame), sort_keys=True))
    by_kind.pop("empty-token", None)  # the tiny model streams some; whether the fake's text has them is its own
    return {name: sorted(found) for name, found in by_kind.items()}


def order(frames: list[Frame], *, chat: bool) -> list[list[str]]:
    """The kinds in the order they came, repeats folded, choice by choice (role, tokens, last; several choices
    interleave as the engine schedules them), then what follows them all (usage, done)."""
    indexes = sorted({f["choices"][0]["index"] for f in frames if isinstance(f, dict) and f.get("choices")})
    by_choice: list[list[Frame]] = [
        [f for f in frames if isinstance(f, dict) and f.get("choices") and f["choices"][0]["index"] == index]
        for index in indexes
    ]
    rest: list[Frame] = [f for f in frames if not (isinstance(f, dict) and f.get("choices"))]
    return [_folded(part, chat=chat) for part in (*by_choice, rest)]


def _folded(frames: list[Frame], *, chat: bool) -> list[str]:
    kinds: list[str] = []
    for frame in frames:
        name = kind(frame, chat=chat).replace("empty-token", "token")
        if not kinds or kinds[-1] != name:
            kinds.append(name)
    return kinds


COMPLETION = {"model": MODEL_NAME, "prompt": "the node drains", "max_tokens": 12, "temperature": 0}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello node"}], "max_tokens": 12}
# Two sampled choices (a greedy n > 1 is refused); no end-of-sequence token, so both run to max_tokens.
SAMPLED = {"n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True}
STREAMED = [
    ("completions", "/v1/completions", {**COMPLETION, "stream": True}),
    ("completions-usage", "/v1/completions", {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}),
    ("completions-ids", "/v1/completions", {**COMPLETION, "stream": True, "return_token_ids": True}),
    ("chat", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("chat-usage", "/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    ("chat-ids", "/v1/chat/completions", {**CHAT, "stream": True, "return_token_ids": True}),
    ("completions-n", "/v1/completions", {**COMPLETION, **SAMPLED, "stream": True, "return_token_ids": True}),
    (
        "chat-n-usage",
        "/v1/chat/completions",
        {**CHAT, **SAMPLED, "stream": True, "stream_options": {"include_usage": True}},
    ),
]
WHOLE = [
    ("completions", "/v1/completions", COMPLETION),
    ("completions-ids", "/v1/completions", {**COMPLETION, "return_token_ids": True}),
    ("chat", "/v1/chat/completions", CHAT),
    ("completions-n", "/v1/completions", {**COMPLETION, **SAMPLED}),
    ("chat-n", "/v1/chat/completions", {**CHAT, **SAMPLED}),
]
# Requests vLLM refuses: the status and the error body's type, code and param must match too.
REFUSED = [
    ("too-long", "/v1/completions", {**COMPLETION, "max_tokens": 5000}),
    ("unknown-model", "/v1/completions", {**COMPLETION, "model": "nope"}),
    ("bad-prompt", "/v1/completions", {**COMPLETION, "prompt": {"a": 1}}),
    ("greedy-n", "/v1/completions", {**COMPLETION, "n": 2}),
    ("bad-stop", "/v1/completions", {**COMPLETION, "stop": 3}),
]


def choices(frames: list[Frame]) -> tuple[set[int], set[int]]:
    """The choice indexes the chunks carry, and how many choices a chunk holds (one: they interleave)."""
    held = [f["choices"] for f in frames if isinstance(f, dict) and f.get("choices")]
    return {c["index"] for choice in held for c in choice}, {len(choice) for choice in held}


def completion_tokens(frames: list[Frame]) -> list[int]:
    """What the usage chunk counts as generated (the prompts' counts differ: each has its own tokenizer)."""
    return [f["usage"]["completion_tokens"] for f in frames if isinstance(f, dict) and f.get("usage")]


async def _both(real_url: str, fake_url: str, path: str, body: dict[str, Any]) -> tuple[Answer, Answer]:
    return await _call(real_url, path, body), await _call(fake_url, path, body)


@pytest.mark.parametrize(("name", "path", "body"), STREAMED, ids=[case[0] for case in STREAMED])
async def test_streamed_frames_match_real_vllm(
    vllm_servers: list[VllmServer], fake_url: str, name: str, path: str, body: dict[str, Any]
) -> None:
    chat = "chat" in path
    (real_status, real), (fake_status, fake) = await _both(vllm_servers[0].url, fake_url, path, body)
    assert (fake_status, real_status) == (200, 200)
    assert isinstance(real, list)
    assert isinstance(fake, list)
    assert order(fake, chat=chat) == order(real, chat=chat)
    assert stream_shapes(fake, chat=chat) == stream_shapes(real, chat=chat)
    assert choices(fake) == choices(real)
    assert completion_tokens(fake) == completion_tokens(real)


@pytest.mark.parametrize(("name", "path", "body"), WHOLE + REFUSED, ids=[case[0] for case in WHOLE + REFUSED])
async def test_whole_responses_and_refusals_match_real_vllm(
    vllm_servers: list[VllmServer], fake_url: str, name: str, path: str, body: dict[str, Any]
) -> None:
    (real_status, real), (fake_status, fake) = await _both(vllm_servers[0].url, fake_url, path, body)
    assert fake_status == real_status
    assert shape(fake) == shape(real)


async def test_a_stop_string_ends_both_streams_alike(vllm_servers: list[VllmServer], fake_url: str) -> None:
    for url in (vllm_servers[0].url, fake_url):
        _, whole = await _call(url, "/v1/completions", {**COMPLETION, "max_tokens": 30})
        assert isinstance(whole, dict)
        text = whole["choices"][0]["text"]
        stop = next(char for char in text[2:] if char.isalnum())
        _, frames = await _call(url, "/v1/completions", {**COMPLETION, "max_tokens": 30, "stream": True, "stop": stop})
        assert isinstance(frames, list)
        last = next(f for f in frames if isinstance(f, dict) and f["choices"] and f["choices"][0]["finish_reason"])
        assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == ("stop", stop), url
        sent = "".join(f["choices"][0]["text"] for f in frames if isinstance(f, dict) and f["choices"])
        assert stop not in sent, url


FAMILIES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


async def _families(url: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Each family the sidecar and dashboards read: its TYPE and its label names."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    found: dict[str, tuple[str, frozenset[str]]] = {}
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in FAMILIES and name not in found:
            labels = frozenset(pair.split("=")[0] for pair in rest.split("}")[0].split(","))
            found[name] = (types[name], labels)
    return found


async def test_metrics_families_match_real_vllm(vllm_servers: list[VllmServer], fake_url: str) -> None:
    real = await _families(vllm_servers[0].url)
    assert set(real) == set(FAMILIES)
    assert await _families(fake_url) == real


async def _idle_close_s(url: str) -> float:
    """Seconds from the end of an answer on a kept connection to the server's close of it."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: %b\r\n\r\n" % parts.netloc.encode())
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = next(int(x[15:]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:"))
        await asyncio.wait_for(reader.readexactly(length), 10)
        answered = time.monotonic()
        assert await asyncio.wait_for(reader.read(1), 30) == b""
        return time.monotonic() - answered
    finally:
        writer.close()


async def test_an_idle_kept_connection_is_closed_after_the_same_time(
    vllm_servers: list[VllmServer], fake_url: str
) -> None:
    """The gateway keeps its connections to an engine; the engine closes one idle for its keep-alive timeout."""
    real, fake = await asyncio.gather(_idle_close_s(vllm_servers[0].url), _idle_close_s(fake_url))
    print(f"idle close: vLLM {real:.2f} s, fake {fake:.2f} s")
    assert 4.0 <= real <= 7.0
    assert abs(fake - real) < 1.5
