from __future__ import annotations

import asyncio

import aiohttp

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
