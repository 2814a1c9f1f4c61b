from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from sidecar.engines import ENGINES, read_engine
from simulate.fakes.engine import EngineConfig
from simulate.fakes.processes import free_port, stream
from tests.conftest import running_engine, scrape


async def test_metrics_follow_the_streams_really_in_flight() -> None:
    async with running_engine(EngineConfig(engines=2, tokens_per_s=200, max_running=1)) as port:
        streams = [asyncio.create_task(stream(port, max_tokens=40)) for _ in range(3)]
        await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{port}/metrics"
        running = await scrape(url, "vllm:num_requests_running")
        waiting = await scrape(url, "vllm:num_requests_waiting")
        assert (running, waiting) == (2, 1)  # one slot per engine, the third request queues
        results = await asyncio.gather(*streams)
        assert all(r[-1] == "[DONE]" and len(r) == 41 for r in results)
        assert await scrape(url, "vllm:num_requests_running") == 0
        assert await scrape(url, "vllm:generation_tokens_total") == 120


async def test_the_page_is_what_the_vllm_reader_expects() -> None:
    async with running_engine(EngineConfig(engines=3)) as port:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/metrics") as response:
            page = await response.text()
        assert "# HELP vllm:num_requests_running Number of requests in model execution batches." in page
        assert 'vllm:num_requests_waiting{engine="2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0' in page
        assert "# TYPE vllm:e2e_request_latency_seconds histogram" in page
        assert 'vllm:kv_cache_usage_perc{engine="0"' in page
        assert read_engine(page, ENGINES["vllm"]).in_flight == 0


async def test_a_leaking_engine_keeps_counting_a_stream_whose_client_left() -> None:
    async with running_engine(EngineConfig(tokens_per_s=50, leak_disconnected=True)) as port:
        task = asyncio.create_task(stream(port, max_tokens=500))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.sleep(0.3)
        assert await scrape(f"http://127.0.0.1:{port}/metrics", "vllm:num_requests_running") == 1


async def test_an_engine_reporting_late_shows_its_gauges_as_they_were_on_its_metrics_port() -> None:
    metrics_port = free_port()
    async with running_engine(EngineConfig(tokens_per_s=50, report_delay_s=0.5, metrics_port=metrics_port)) as port:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        running = asyncio.create_task(stream(port, max_tokens=50))  # 1 s
        await asyncio.sleep(0.2)
        assert await scrape(url, "vllm:num_requests_running") == 0, "not reported yet"
        await asyncio.sleep(0.5)
        assert await scrape(url, "vllm:num_requests_running") == 1
        await running
        assert await scrape(url, "vllm:num_requests_running") == 1, "the end is reported late too"
        await asyncio.sleep(0.6)
        assert await scrape(url, "vllm:num_requests_running") == 0


async def test_a_lingering_stream_leaves_the_gauge_before_its_last_bytes() -> None:
    async with running_engine(EngineConfig(tokens_per_s=100, linger_s=0.5)) as port:
        url = f"http://127.0.0.1:{port}/metrics"
        running = asyncio.create_task(stream(port, max_tokens=10))  # 0.1 s, then 0.5 s with the gauge at 0
        await asyncio.sleep(0.3)
        assert not running.done()
        assert await scrape(url, "vllm:num_requests_running") == 0
        assert (await running)[-1] == "[DONE]"
        assert await scrape(url, "vllm:num_requests_running") == 0


async def events(port: int, path: str, body: dict[str, Any]) -> list[Any]:
    """Every ``data:`` payload of one streamed response, JSON decoded ([DONE] as the string); stops at a cut."""
    out: list[Any] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}{path}", json={**body, "stream": True}) as response,
    ):
        try:
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    out.append(data if data == "[DONE]" else json.loads(data))
        except aiohttp.ClientPayloadError:
            out.append("cut")
    return out


def completion_text(chunks: list[Any]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if isinstance(c, dict) and c["choices"])


def chat_text(chunks: list[Any]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if isinstance(c, dict) and c["choices"])


FAST = EngineConfig(tokens_per_s=2000)
WORDS_ONLY = EngineConfig(tokens_per_s=2000, partial_utf8=False)  # a model whose text round-trips through its ids


def ids_of(chunks: list[Any]) -> list[int]:
    return [i for c in chunks if isinstance(c, dict) and c["choices"] for i in c["choices"][0]["token_ids"] or ()]


async def test_a_completion_continued_from_prompt_and_text_so_far_yields_the_uninterrupted_tokens() -> None:
    async with running_engine(WORDS_ONLY) as port:
        whole = completion_text(await events(port, "/v1/completions", {"prompt": "tell me", "max_tokens": 30}))
        head = completion_text(await events(port, "/v1/completions", {"prompt": "tell me", "max_tokens": 12}))
        rest = await events(port, "/v1/completions", {"prompt": "tell me" + head, "max_tokens": 18})
        assert head + completion_text(rest) == whole
        assert len(whole.split()) == 30


async def test_text_so_far_does_not_continue_exactly_where_characters_span_tokens_as_on_vllm() -> None:
    async with running_engine(FAST) as port:
        whole = completion_text(await events(port, "/v1/completions", {"prompt": "tell me", "max_tokens": 30}))
        head = completion_text(await events(port, "/v1/completions", {"prompt": "tell me", "max_tokens": 12}))
        rest = await events(port, "/v1/completions", {"prompt": "tell me" + head, "max_tokens": 18})
        assert "\ufffd" in head  # a first half generated without its second: U+FFFD, and other ids when tokenised
        assert head + completion_text(rest) != whole


async def test_a_completion_continued_from_token_ids_yields_the_uninterrupted_tokens() -> None:
    body = {"prompt": "tell me", "return_token_ids": True}
    async with running_engine(FAST) as port:
        whole = await events(port, "/v1/completions", {**body, "max_tokens": 20})
        head = await events(port, "/v1/completions", {**body, "max_tokens": 7})
        assert head[-2]["choices"][0]["text"] != ""  # (a head ending inside a character is the next test's)
        prompt_ids = head[0]["choices"][0]["prompt_token_ids"]
        rest = await events(port, "/v1/completions", {**body, "prompt": prompt_ids + ids_of(head), "max_tokens": 13})
        assert completion_text(head) + completion_text(rest) == completion_text(whole)
        assert ids_of(head) + ids_of(rest) == ids_of(whole)
        assert head[1]["choices"][0]["prompt_token_ids"] is None  # prompt ids ride on the first chunk only


async def test_token_ids_ending_inside_a_character_make_the_first_chunk_echo_the_prompt_as_vllm_does() -> None:
    body = {"prompt": "tell me", "return_token_ids": True, "max_tokens": 40}
    async with running_engine(FAST) as port:
        whole = await events(port, "/v1/completions", body)
        chunks = [c for c in whole if isinstance(c, dict) and c["choices"]]
        cut = next(i for i, c in enumerate(chunks) if i and c["choices"][0]["text"] == "") + 1
        sent = completion_text(chunks[:cut])
        prompt_ids = chunks[0]["choices"][0]["prompt_token_ids"]
        rest = await events(
            port, "/v1/completions", {**body, "prompt": prompt_ids + ids_of(chunks[:cut]), "max_tokens": 4}
        )
        assert rest[0]["choices"][0]["text"].startswith(sent)  # the text the client already had, again
        assert ids_of(rest) == ids_of(chunks)[cut : cut + 4]  # the tokens themselves are right


async def test_empty_text_chunks_are_tokens_and_usage_counts_them() -> None:
    body = {"prompt": "tell me", "return_token_ids": True, "max_tokens": 40, "stream_options": {"include_usage": True}}
    async with running_engine(FAST) as port:
        whole = await events(port, "/v1/completions", body)
    chunks = [c for c in whole if isinstance(c, dict) and c["choices"]]
    assert len(chunks) == 40
    assert any(c["choices"][0]["text"] == "" for c in chunks)
    assert whole[-2]["usage"]["completion_tokens"] == 40


async def test_an_engine_without_token_ids_answers_without_them_or_refuses_the_field() -> None:
    body = {"prompt": "tell me", "return_token_ids": True, "max_tokens": 3}
    async with running_engine(EngineConfig(tokens_per_s=2000, token_ids="ignored")) as port:
        chunks = await events(port, "/v1/completions", body)
        assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [None] * 3
    async with (
        running_engine(EngineConfig(tokens_per_s=2000, token_ids="refused")) as port,
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response,
    ):
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "return_token_ids"


async def test_a_chat_continued_as_a_final_assistant_message_yields_the_uninterrupted_tokens() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with running_engine(WORDS_ONLY) as port:
        whole = chat_text(await events(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 25}))
        head = chat_text(await events(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 10}))
        continued = {
            "messages": [*messages, {"role": "assistant", "content": head}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 15,
        }
        assert head + chat_text(await events(port, "/v1/chat/completions", continued)) == whole
        assert len(whole.split()) == 25


async def test_a_chat_stream_has_vllms_shape_role_first_finish_on_the_last_token_then_usage() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream_options": {"include_usage": True}}
    async with running_engine(FAST) as port:
        chunks = await events(port, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:5]] == [None, None, None, "length"]
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"]["completion_tokens"] == 4
    assert chunks[6] == "[DONE]"
    assert len(chunks) == 7
    assert {c["object"] for c in chunks[:6]} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks[:6]}) == 1


async def test_a_stop_string_ends_the_stream_where_it_appears_and_is_left_out() -> None:
    async with running_engine(FAST) as port:
        whole = completion_text(await events(port, "/v1/completions", {"prompt": "p", "max_tokens": 40}))
        word = whole.split()[5]
        chunks = await events(port, "/v1/completions", {"prompt": "p", "max_tokens": 40, "stop": [word]})
        inside = await events(port, "/v1/completions", {"prompt": "p", "max_tokens": 40, "stop": word[1:3]})
    assert chunks[-2]["choices"][0]["text"] == " "  # the token " word" up to its stop string
    assert (chunks[-2]["choices"][0]["finish_reason"], chunks[-2]["choices"][0]["stop_reason"]) == ("stop", word)
    assert completion_text(chunks) == whole[: whole.index(word)]
    assert completion_text(inside) == whole[: whole.index(word[1:3])]  # a stop string inside a token, as vLLM


async def test_models_lists_the_served_model() -> None:
    async with (
        running_engine(FAST) as port,
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/v1/models") as response,
    ):
        body = await response.json()
    assert [m["id"] for m in body["data"]] == [FAST.model]


@pytest.mark.parametrize(
    ("fault", "tail"),
    [("abort", ["abort", "[DONE]"]), ("error", ["error", "[DONE]"]), ("drop", ["cut"])],
)
async def test_a_faulty_engine_fails_each_stream_after_its_tokens(fault: str, tail: list[str]) -> None:
    async with running_engine(EngineConfig(tokens_per_s=2000, fault=fault, fault_after=3)) as port:
        chunks = await events(port, "/v1/completions", {"prompt": "p", "max_tokens": 10})

    def kind(chunk: Any) -> str:
        if isinstance(chunk, str):
            return chunk
        return "error" if "error" in chunk else str(chunk["choices"][0]["finish_reason"])

    assert [kind(c) for c in chunks] == ["None"] * 3 + tail


async def test_an_unavailable_engine_answers_503_before_any_stream() -> None:
    async with (
        running_engine(EngineConfig(fault="unavailable")) as port,
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "p"}) as response,
    ):
        assert response.status == 503
        assert (await response.json())["error"]["code"] == 503


async def test_sampled_choices_interleave_each_its_own_and_usage_counts_the_prompt_once() -> None:
    body = {"prompt": "tell me", "n": 3, "temperature": 0.8, "max_tokens": 6, "stream_options": {"include_usage": True}}
    async with running_engine(FAST) as port:
        streamed = await events(port, "/v1/completions", {**body, "return_token_ids": True})
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/v1/completions"
            async with session.post(url, json={**body, "stream": False}) as response:
                whole = await response.json()
            for n, param in ((0, "n"), ("2", "body.n")):
                async with session.post(url, json={**body, "n": n}) as refused:
                    assert refused.status == 400
                    assert (await refused.json())["error"]["param"] == param
    chunks = [c for c in streamed if isinstance(c, dict) and c["choices"]]
    assert [c["choices"][0]["index"] for c in chunks[:6]] == [0, 1, 2, 0, 1, 2]
    ids = {
        i: [t for c in chunks if c["choices"][0]["index"] == i for t in c["choices"][0]["token_ids"]] for i in range(3)
    }
    assert all(len(v) == 6 for v in ids.values())
    assert len({tuple(v) for v in ids.values()}) == 3, "each choice a sample of its own"
    assert [c["choices"][0]["finish_reason"] for c in chunks[-3:]] == ["length"] * 3
    assert streamed[-2]["usage"] == {"prompt_tokens": 2, "total_tokens": 20, "completion_tokens": 18}
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert whole["usage"]["completion_tokens"] == 18
