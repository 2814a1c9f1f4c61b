from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from agent.notices.imds import ERROR_KINDS, ImdsClient, ImdsError, ImdsMetrics, ImdsSource
from agent.notices.imds_parse import INSTANCE_ID, SPOT, TOKEN
from agent.notices.notice import Kind, Notice
from simulate.fakes.imds import FakeImds, control, serving
from simulate.fakes.processes import free_port, start, wait_http
from spotdrain.metrics import CollectorRegistry

NOTICE_TIME = datetime(2026, 11, 29, 10, 22, tzinfo=UTC)


class Collected:
    """Runs a source's notice stream in the background and keeps what it yields."""

    def __init__(self, source: ImdsSource, registry: CollectorRegistry) -> None:
        self.source = source
        self.registry = registry
        self.notices: list[Notice] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for notice in self.source.notices():
            self.notices.append(notice)

    def errors(self, kind: str) -> float:
        return self.registry.get_sample_value("spotdrain_imds_errors_total", {"kind": kind}) or 0.0

    def polls(self) -> float:
        return self.registry.get_sample_value("spotdrain_imds_polls_total") or 0.0

    async def until(self, check: Callable[[], bool], *, timeout_s: float = 3.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                if self.task.done():
                    self.task.result()
                    raise AssertionError("the notice stream ended")
                await asyncio.sleep(0.01)


@pytest.fixture
def fake() -> FakeImds:
    return FakeImds(instance_id="i-0aaaabbbbccccdddd")


@pytest.fixture
async def url(fake: FakeImds) -> AsyncIterator[str]:
    async with serving(fake) as base_url:
        yield base_url


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def collect(session: aiohttp.ClientSession, url: str) -> AsyncIterator[Callable[..., Collected]]:
    running: list[Collected] = []

    def started(**options: Any) -> Collected:
        defaults: dict[str, Any] = {"interval_s": 0.05, "max_backoff_s": 0.2, "instance_id": "i-0aaaabbbbccccdddd"}
        registry = CollectorRegistry()
        source = ImdsSource(session=session, base_url=url, metrics=ImdsMetrics(registry), **(defaults | options))
        running.append(Collected(source, registry))
        return running[-1]

    yield started
    for each in running:
        each.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await each.task


async def token(session: aiohttp.ClientSession, url: str, ttl: str = "60") -> str:
    async with session.put(url + TOKEN, headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl}) as response:
        assert response.status == 200
        return await response.text()


async def test_the_fake_refuses_a_get_without_a_token(url: str, session: aiohttp.ClientSession) -> None:
    async with session.get(url + INSTANCE_ID) as response:
        assert response.status == 401
    headers = {"X-aws-ec2-metadata-token": await token(session, url)}
    async with session.get(url + INSTANCE_ID, headers=headers) as response:
        assert (response.status, await response.text()) == (200, "i-0aaaabbbbccccdddd")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 400),
        ({"X-aws-ec2-metadata-token-ttl-seconds": "0"}, 400),
        ({"X-aws-ec2-metadata-token-ttl-seconds": "21601"}, 400),
        ({"X-aws-ec2-metadata-token-ttl-seconds": "abc"}, 400),
        ({"X-aws-ec2-metadata-token-ttl-seconds": "60", "X-Forwarded-For": "10.0.0.1"}, 403),
        ({"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, 200),
    ],
)
async def test_the_fake_checks_token_requests_as_imds_does(
    url: str, session: aiohttp.ClientSession, headers: dict[str, str], status: int
) -> None:
    async with session.put(url + TOKEN, headers=headers) as response:
        assert response.status == status


async def test_the_fake_is_driven_over_http(url: str, session: aiohttp.ClientSession) -> None:
    await control(session, url, "schedule_spot", action="stop", time="2026-11-29T10:22:00Z")
    event_id = await control(
        session, url, "add_maintenance", code="instance-stop", not_before="1 Dec 2026 00:00:00 GMT"
    )
    headers = {"X-aws-ec2-metadata-token": await token(session, url)}
    async with session.get(url + SPOT, headers=headers) as response:
        assert await response.json(content_type=None) == {"action": "stop", "time": "2026-11-29T10:22:00Z"}
    async with session.get(url + "/latest/meta-data/events/maintenance/scheduled", headers=headers) as response:
        [event] = await response.json(content_type=None)
    assert (event["EventId"], event["Code"], event["State"]) == (event_id, "instance-stop", "active")
    assert (await control(session, url, "request_counts"))[SPOT] == 1
    with pytest.raises(RuntimeError, match="no control method"):
        await control(session, url, "shutdown")


async def test_the_fake_runs_as_its_own_process(tmp_path: Path, session: aiohttp.ClientSession) -> None:
    port = free_port()
    process = await start(["-m", "simulate.fakes.imds", "--port", str(port)], log_path=tmp_path / "imds.log")
    try:
        base_url = f"http://127.0.0.1:{port}"
        await wait_http(base_url + INSTANCE_ID, status=401)
        await control(session, base_url, "schedule_rebalance", time="2026-11-29T10:20:00Z")
        headers = {"X-aws-ec2-metadata-token": await token(session, base_url)}
        async with session.get(base_url + "/latest/meta-data/events/recommendations/rebalance", headers=headers) as r:
            assert await r.json(content_type=None) == {"noticeTime": "2026-11-29T10:20:00Z"}
    finally:
        process.terminate()
        await process.wait()


def test_error_kinds_are_counted_from_zero() -> None:
    registry = CollectorRegistry()
    ImdsMetrics(registry)
    for kind in ERROR_KINDS:
        assert registry.get_sample_value("spotdrain_imds_errors_total", {"kind": kind}) == 0
    assert registry.get_sample_value("spotdrain_imds_polls_total") == 0


async def test_the_instance_id_is_discovered_at_start(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    fake.fail_next(INSTANCE_ID, 503, count=2)
    fake.schedule_spot("terminate", NOTICE_TIME)
    source = collect(instance_id=None)
    await source.until(lambda: len(source.notices) == 1)
    assert source.notices[0].instance_id == "i-0aaaabbbbccccdddd"
    assert fake.requests[INSTANCE_ID] == 3
    assert source.errors("server") == 2


async def test_a_spot_notice_is_yielded_once_across_many_polls(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    source = collect()
    await source.until(lambda: fake.requests[SPOT] >= 3)
    assert source.notices == []
    with capture_logs() as logs:
        fake.schedule_spot("terminate", NOTICE_TIME)
        # The fake counts a request when it arrives, the source a poll once its answer is read: wait for both.
        await source.until(lambda: fake.requests[SPOT] >= 15 and source.polls() >= 15)
    [notice] = source.notices
    assert (notice.kind, notice.deadline, notice.detail) == (Kind.SPOT_INTERRUPTION, NOTICE_TIME, "terminate")
    assert [log["notice"] for log in logs if log["event"] == "imds.notice"] == [notice.id]
    assert source.polls() >= 15
    assert fake.requests[TOKEN] == 1


async def test_a_changed_spot_action_is_a_new_notice(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    fake.schedule_spot("hibernate", NOTICE_TIME)
    source = collect()
    await source.until(lambda: len(source.notices) == 1)
    fake.schedule_spot("stop", NOTICE_TIME)
    await source.until(lambda: len(source.notices) == 2)
    assert [notice.detail for notice in source.notices] == ["hibernate", "stop"]


async def test_a_rebalance_recommendation_is_yielded(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    fake.schedule_rebalance(NOTICE_TIME)
    source = collect()
    await source.until(lambda: len(source.notices) == 1)
    [notice] = source.notices
    assert (notice.kind, notice.deadline) == (Kind.REBALANCE_RECOMMENDATION, NOTICE_TIME + timedelta(seconds=120))


async def test_a_canceled_maintenance_event_is_withdrawn_once(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    event_id = fake.add_maintenance(code="instance-retirement", not_before=NOTICE_TIME)
    source = collect()
    await source.until(lambda: len(source.notices) == 1)
    fake.set_maintenance_state(event_id, "canceled")
    await source.until(lambda: len(source.notices) == 2)
    polled = fake.requests["/latest/meta-data/events/maintenance/scheduled"]
    await source.until(lambda: fake.requests["/latest/meta-data/events/maintenance/scheduled"] >= polled + 5)
    active, withdrawn = source.notices
    assert (active.kind, active.detail, active.deadline) == (Kind.SCHEDULED_MAINTENANCE, event_id, NOTICE_TIME)
    assert not active.withdrawn
    assert withdrawn.withdrawn
    assert withdrawn.id == active.id


async def test_lifecycle_terminated_is_an_asg_termination_with_a_steady_deadline(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    path = "/latest/meta-data/autoscaling/target-lifecycle-state"
    fake.set_lifecycle_state("InService")
    source = collect(asg_budget=timedelta(seconds=90))
    await source.until(lambda: fake.requests[path] >= 3)
    assert source.notices == []
    before = datetime.now(UTC)
    fake.set_lifecycle_state("Terminated")
    await source.until(lambda: len(source.notices) == 1)
    after = datetime.now(UTC)
    await source.until(lambda: fake.requests[path] >= 15)
    [notice] = source.notices
    assert notice.kind is Kind.ASG_TERMINATION
    assert before + timedelta(seconds=90) <= notice.deadline <= after + timedelta(seconds=90)


async def test_the_token_is_renewed_after_a_401(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    source = collect()
    await source.until(lambda: fake.requests[SPOT] >= 3)
    fake.expire_tokens()
    fake.schedule_spot("terminate", NOTICE_TIME)
    await source.until(lambda: len(source.notices) == 1)
    assert fake.refused >= 1
    assert fake.requests[TOKEN] == 2
    assert source.errors("unauthorized") == 0


async def test_the_token_is_renewed_before_it_expires(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    source = collect(token_ttl_s=1)
    await source.until(lambda: fake.requests[TOKEN] >= 2)
    assert fake.refused == 0


async def test_imdsv1_is_used_when_allowed_and_no_token_can_be_had(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    fake.allow_v1 = True
    fake.fail_next(TOKEN, 405, count=1000)
    fake.schedule_spot("terminate", NOTICE_TIME)
    with capture_logs() as logs:
        source = collect(allow_v1=True)
        await source.until(lambda: len(source.notices) == 1)
    assert [log["event"] for log in logs].count("imds.v1_fallback") == 1


async def test_imdsv1_is_not_used_unless_allowed(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    fake.allow_v1 = True
    fake.fail_next(TOKEN, 403, count=1000)
    fake.schedule_spot("terminate", NOTICE_TIME)
    source = collect()
    # Counted once the source has read each refusal: the fake counts a request before it answers.
    await source.until(lambda: source.errors("unauthorized") >= 8)
    assert source.notices == []
    assert fake.requests[SPOT] == 0


async def test_an_outage_is_counted_by_kind_and_the_notice_still_arrives(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    fake.schedule_spot("terminate", NOTICE_TIME)
    for status in (500, 503, 429):
        fake.fail_next("*", status, count=4)
    with capture_logs() as logs:
        source = collect()
        await source.until(lambda: len(source.notices) == 1)
    assert (source.errors("server"), source.errors("throttled")) == (8, 4)
    failing = [(log["event"], log.get("kind")) for log in logs if log["event"].startswith("imds.")]
    assert failing[:3] == [("imds.failing", "server"), ("imds.failing", "throttled"), ("imds.recovered", None)]


async def test_a_slow_imds_counts_timeouts_then_recovers(fake: FakeImds, collect: Callable[..., Collected]) -> None:
    fake.set_delay(0.3)
    fake.schedule_spot("stop", NOTICE_TIME)
    source = collect(request_timeout_s=0.1)
    await source.until(lambda: source.errors("timeout") >= 3)
    assert source.notices == []
    fake.set_delay(0)
    await source.until(lambda: len(source.notices) == 1)


async def test_a_malformed_answer_is_counted_while_other_paths_still_yield(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    fake.set_lifecycle_state("not a state!")
    fake.schedule_spot("terminate", NOTICE_TIME)
    with capture_logs() as logs:
        source = collect()
        await source.until(lambda: len(source.notices) == 1 and source.errors("malformed") >= 5)
    assert [log["kind"] for log in logs if log["event"] == "imds.failing"] == ["malformed"]


CAPTIVE_PAGE = "<html>\n<head><title>Sign in to the network</title></head>\n<body>Accept the terms</body>\n</html>\n"


async def test_a_token_request_answered_by_a_proxys_page_is_counted_logged_once_and_retried(
    fake: FakeImds, collect: Callable[..., Collected]
) -> None:
    fake.schedule_spot("terminate", NOTICE_TIME)
    fake.answer_tokens_with(CAPTIVE_PAGE)
    with capture_logs() as logs:
        source = collect()
        await source.until(lambda: source.errors("bad_token") >= 8)
        assert source.notices == []
        assert fake.requests[SPOT] == 0, "the page is never sent on as a token"
        fake.answer_tokens_with(None)
        await source.until(lambda: len(source.notices) == 1)
    failing = [log for log in logs if log["event"] == "imds.failing"]
    assert [log["kind"] for log in failing] == ["bad_token"]
    assert "<html>" in failing[0]["error"], "the log shows what came back"
    assert any(log["event"] == "imds.recovered" for log in logs)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=300) | st.sampled_from([CAPTIVE_PAGE.encode(), b"", b"AQAE" * 14 + b"\r\nX: y"]))
async def test_no_answer_to_a_token_request_raises_anything_but_an_imds_error(
    fake: FakeImds, url: str, session: aiohttp.ClientSession, body: bytes
) -> None:
    fake.answer_tokens_with(body)
    client = ImdsClient(session=session, base_url=url, token_ttl_s=60, allow_v1=False, timeout_s=1.0)
    with pytest.raises(ImdsError) as raised:
        await client.get(INSTANCE_ID)  # a token the fake did not issue is refused, so this never succeeds
    assert raised.value.kind in ERROR_KINDS
