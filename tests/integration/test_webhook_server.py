"""The webhook server over real TLS on 127.0.0.1: a client that verifies its certificate against the CA, as the
API server does with the configuration's caBundle, gets AdmissionReviews back; bad bodies get 4xx, never a hang;
every answer is counted by outcome and timed."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import generate_latest

from inject.spec import Options
from simulate.fakes.processes import free_port
from simulate.fakes.tls import TlsFiles, server_ssl_context, write_tls_files
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import serve
from tests.integration.test_metrics_pages import PROMTOOL, promtool_problems
from tests.unit.test_webhook_admission import admission_review, vllm_pod
from webhook import server
from webhook.admission import LABEL
from webhook.metrics import OUTCOMES, WebhookMetrics
from webhook.server import webhook_app

READ_TIMEOUT_S = 0.5


@dataclass
class Webhook:
    url: str
    client_ssl: ssl.SSLContext
    files: TlsFiles
    server_ssl: ssl.SSLContext
    registry: CollectorRegistry

    def admissions(self) -> dict[str, float]:
        sample = self.registry.get_sample_value
        return {o: sample("spotdrain_webhook_admissions_total", {"outcome": o}) or 0 for o in OUTCOMES}

    def timed(self) -> float:
        return self.registry.get_sample_value("spotdrain_webhook_admission_duration_seconds_count") or 0


@pytest.fixture
async def webhook(tmp_path: Path) -> AsyncIterator[Webhook]:
    files = write_tls_files(tmp_path / "tls")
    registry = CollectorRegistry()
    metrics = WebhookMetrics.create(registry)
    app = webhook_app(Options(), metrics=metrics, max_body_bytes=64 * 1024, read_timeout_s=READ_TIMEOUT_S)
    listening = asyncio.Event()
    port = free_port()
    context = server_ssl_context(files)
    task = asyncio.create_task(
        serve(app, host="127.0.0.1", port=port, ready_flag=listening, name="webhook", ssl_context=context)
    )
    await asyncio.wait_for(listening.wait(), 10)
    try:
        client = ssl.create_default_context(cafile=str(files.ca_path))
        yield Webhook(f"https://127.0.0.1:{port}", client, files, context, registry)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _post(webhook: Webhook, body: bytes) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            webhook.url + "/mutate",
            data=body,
            headers={"Content-Type": "application/json"},
            ssl=webhook.client_ssl,
            timeout=aiohttp.ClientTimeout(total=10),
        ) as response,
    ):
        return response.status, await response.read()


async def test_a_labelled_pod_is_answered_with_a_patch_over_verified_tls(webhook: Webhook) -> None:
    status, body = await _post(webhook, admission_review(vllm_pod({LABEL: "true"}), uid="u-1"))
    assert status == 200
    answer = json.loads(body)
    assert answer["response"]["uid"] == "u-1"
    assert answer["response"]["allowed"] is True
    operations = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert {"op": "add", "path": "/spec/containers/1"} in [{k: o[k] for k in ("op", "path")} for o in operations]


async def test_healthz_answers_over_tls(webhook: Webhook) -> None:
    async with aiohttp.ClientSession() as session, session.get(webhook.url + "/healthz", ssl=webhook.client_ssl) as r:
        assert (r.status, await r.text()) == (200, "ok\n")


async def test_a_client_that_does_not_trust_the_ca_is_refused_the_handshake(webhook: Webhook) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await session.get(webhook.url + "/healthz", ssl=ssl.create_default_context())


async def test_plain_http_gets_no_answer(webhook: Webhook) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            await session.get(webhook.url.replace("https", "http") + "/healthz", timeout=aiohttp.ClientTimeout(total=5))


@pytest.mark.parametrize(
    "body", [b"garbage", b"{}", b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}']
)
async def test_a_body_that_is_not_a_review_is_a_400_with_the_reason(webhook: Webhook, body: bytes) -> None:
    status, answer = await _post(webhook, body)
    assert status == 400
    assert json.loads(answer)["error"]


async def test_a_body_over_the_limit_is_refused_with_413(webhook: Webhook) -> None:
    status, _ = await _post(webhook, b" " * (64 * 1024 + 1))
    assert status == 413


async def test_a_client_that_stops_sending_mid_body_gets_408_and_the_server_keeps_serving(webhook: Webhook) -> None:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", int(webhook.url.rsplit(":", 1)[1]), ssl=webhook.client_ssl
    )
    writer.write(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S + 10)
    assert status_line.startswith(b"HTTP/1.1 408")
    writer.close()
    status, _ = await _post(webhook, admission_review(vllm_pod({LABEL: "true"})))
    assert status == 200


async def test_a_client_that_drops_the_connection_mid_body_does_not_stop_the_server(webhook: Webhook) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", int(webhook.url.rsplit(":", 1)[1]), ssl=webhook.client_ssl)
    writer.write(b'POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"apiVersion"')
    await writer.drain()
    writer.transport.abort()
    status, _ = await _post(webhook, admission_review(vllm_pod({LABEL: "true"})))
    assert status == 200


async def test_a_pod_that_trips_the_mutation_is_admitted_unchanged_with_a_warning(
    webhook: Webhook, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(request: object, options: object) -> None:
        raise KeyError("a shape no rule foresaw")

    monkeypatch.setattr(server, "mutate", broken)
    status, body = await _post(webhook, admission_review(vllm_pod({LABEL: "true"}), uid="u-2"))
    assert status == 200
    response = json.loads(body)["response"]
    assert (response["uid"], response["allowed"], "patch" in response) == ("u-2", True, False)
    assert "could not read this Pod" in response["warnings"][0]


async def test_a_renewed_certificate_is_served_to_new_connections_without_a_restart(
    webhook: Webhook, tmp_path: Path
) -> None:
    reloader = asyncio.create_task(
        server.certificate_reloader(
            webhook.server_ssl, webhook.files.cert_path, webhook.files.key_path, interval_s=0.05
        )
    )
    try:
        webhook.files.key_path.write_bytes(b"half-written")  # the kubelet mid-update: the old pair stays
        await asyncio.sleep(0.2)
        await _healthz(webhook.url, webhook.client_ssl)
        renewed = write_tls_files(tmp_path / "renewed")
        webhook.files.cert_path.write_bytes(renewed.cert_path.read_bytes())
        webhook.files.key_path.write_bytes(renewed.key_path.read_bytes())
        trusting_renewed = ssl.create_default_context(cafile=str(renewed.ca_path))

        async def served() -> bool:
            try:
                await _healthz(webhook.url, trusting_renewed)
            except aiohttp.ClientConnectorCertificateError:
                return False
            return True

        async with asyncio.timeout(10):
            while not await served():
                await asyncio.sleep(0.05)
    finally:
        reloader.cancel()
        await asyncio.gather(reloader, return_exceptions=True)


async def _healthz(url: str, context: ssl.SSLContext) -> None:
    async with aiohttp.ClientSession() as session, session.get(url + "/healthz", ssl=context) as response:
        assert response.status == 200


async def test_each_answer_is_counted_under_its_outcome_and_timed(webhook: Webhook) -> None:
    assert webhook.admissions() == dict.fromkeys(OUTCOMES, 0), "every series exists from start"
    no_engine = vllm_pod({LABEL: "true"})
    no_engine["spec"]["containers"] = [{"name": "web", "image": "nginx:1.27"}]
    bodies = [
        admission_review(vllm_pod({LABEL: "true"})),  # mutated
        admission_review(vllm_pod({LABEL: "false"})),  # unchanged: it declines
        admission_review(no_engine),  # skipped, with a warning
        b"garbage",  # 400
        b" " * (64 * 1024 + 1),  # 413
    ]
    statuses = [(await _post(webhook, body))[0] for body in bodies]
    assert statuses == [200, 200, 200, 400, 413]
    assert webhook.admissions() == {"mutated": 1, "unchanged": 1, "skipped": 1, "bad_request": 2}
    assert webhook.timed() == 5


async def test_a_client_that_stalls_mid_body_is_a_bad_request_counted_once(webhook: Webhook) -> None:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", int(webhook.url.rsplit(":", 1)[1]), ssl=webhook.client_ssl
    )
    writer.write(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
    await writer.drain()
    assert (await asyncio.wait_for(reader.readline(), READ_TIMEOUT_S + 10)).startswith(b"HTTP/1.1 408")
    writer.close()
    assert webhook.admissions()["bad_request"] == 1


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian's prometheus package)")
async def test_the_webhooks_page_passes_promtool(webhook: Webhook) -> None:
    await _post(webhook, admission_review(vllm_pod({LABEL: "true"})))
    assert promtool_problems(generate_latest(webhook.registry).decode()) == ""
