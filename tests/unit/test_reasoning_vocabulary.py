"""What a parsed chat's continuation asks the next backend at a break: the text of the ids so far, and the markers.

Served on 127.0.0.1 by an aiohttp app answering as vLLM 0.32's ``/detokenize`` and ``/tokenize`` do
(vllm/entrypoints/serve/tokenize/api_router.py; measured: ``{"prompt": text}``, and ``{"count", "max_model_len",
"tokens", "token_strs"}``), decoding the fake engine's byte-level tokens whole, as a Hugging Face tokenizer's
``decode`` does: bytes that make no character yet are U+FFFD. tests/engines/test_gateway_reasoning.py asks real vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web

from gateway.reasoning import Markers, Piece
from gateway.vocabulary import generated, markers
from simulate.fakes.tokens import SPLIT, VOCAB, text_of
from tests.conftest import serving_app

MODEL = "m"
NAIVE_START = VOCAB.index(SPLIT[2])  # " na\xc3": ends inside "ï"
NAIVE_END = VOCAB.index(SPLIT[3])
# The thinking model's ids for the markers (simulate/vllm/transcripts.py adds them as tokens; /tokenize, measured).
VOCABULARY = {"<think></think>": [700, 701], "<|im_start|><|im_end|>": [1, 2]}


@asynccontextmanager
async def vllm_like(*, status: int = 200, delay_s: float = 0.0) -> AsyncIterator[tuple[str, list[object]]]:
    asked: list[object] = []

    async def detokenize(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body)
        await asyncio.sleep(delay_s)
        return web.json_response({"prompt": text_of(body["tokens"])}, status=status)

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body)
        tokens = VOCABULARY[body["prompt"]]
        return web.json_response({"count": len(tokens), "max_model_len": 2048, "tokens": tokens, "token_strs": None})

    app = web.Application()
    app.router.add_post("/detokenize", detokenize)
    app.router.add_post("/tokenize", tokenize)
    async with serving_app(app) as port:
        yield f"http://127.0.0.1:{port}", asked


async def test_the_text_so_far_ends_at_the_last_whole_character() -> None:
    async with vllm_like() as (url, asked), aiohttp.ClientSession() as session:
        whole = await generated(session, url, [0, 1], model=MODEL, timeout_s=5)
        cut = await generated(session, url, [0, 1, NAIVE_START], model=MODEL, timeout_s=5)
        done = await generated(session, url, [0, NAIVE_START, NAIVE_END], model=MODEL, timeout_s=5)
    assert whole == Piece(" amber basalt", (0, 1))
    assert cut == Piece(" amber basalt", (0, 1))  # " na" and half of "ï" came as no text: they come again
    assert done == Piece(" amber naïve", (0, NAIVE_START, NAIVE_END))
    assert asked[1] == {"model": MODEL, "tokens": [0, 1, NAIVE_START]}


async def test_nothing_generated_is_an_empty_piece_asked_of_no_one() -> None:
    async with vllm_like() as (url, asked), aiohttp.ClientSession() as session:
        assert await generated(session, url, [], model=MODEL, timeout_s=5) == Piece("", ())
    assert asked == []


async def test_the_markers_are_asked_without_special_tokens_added_and_the_turns_for_qwen3_alone() -> None:
    async with vllm_like() as (url, asked), aiohttp.ClientSession() as session:
        assert await markers(session, url, model=MODEL, timeout_s=5) == Markers(700, 701)
        assert await markers(session, url, model=MODEL, timeout_s=5, turns=True) == Markers(700, 701, frozenset({1, 2}))
    think = {"model": MODEL, "prompt": "<think></think>", "add_special_tokens": False}
    assert asked == [think, think, {**think, "prompt": "<|im_start|><|im_end|>"}]


async def test_a_backend_that_cannot_say_gives_nothing_to_continue_from() -> None:
    async with aiohttp.ClientSession() as session:
        async with vllm_like(status=404) as (url, _):
            assert await generated(session, url, [0], model=MODEL, timeout_s=5) is None
        async with vllm_like(delay_s=2) as (url, _):
            assert await generated(session, url, [0], model=MODEL, timeout_s=0.2) is None
        async with vllm_like() as (url, _):
            closed = url.rsplit(":", 1)[0] + ":1"
            assert await generated(session, closed, [0], model=MODEL, timeout_s=1) is None
            assert await markers(session, closed, model=MODEL, timeout_s=1) is None
