"""Self-managed TLS against the fake API server: replicas share one certificate through a Secret, and the
configuration's caBundle ends up trusting exactly the CA that signed it."""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from simulate.fakes.kube import FakeKube
from simulate.fakes.kube_resources import MUTATING_WEBHOOKS, SECRETS
from spotdrain.retry import ApiError
from webhook.selfmanaged import ProvisionError, provision
from webhook.settings import TlsSettings

NAMESPACE, SERVICE, CONFIGURATION = "spotdrain", "spotdrain-webhook", "spotdrain-webhook"
SECRETS_PATH = f"/api/v1/namespaces/{NAMESPACE}/secrets"


def configuration() -> dict[str, object]:
    hook = {
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "clientConfig": {"service": {"name": SERVICE, "namespace": NAMESPACE, "path": "/mutate", "port": 443}},
    }
    return {
        "metadata": {"name": CONFIGURATION},
        "webhooks": [{"name": "namespace.inject.spotdrain.io", **hook}, {"name": "pod.inject.spotdrain.io", **hook}],
    }


@pytest.fixture
async def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FakeKube]:
    async with FakeKube() as kube:
        for name, value in kube.service_env().items():
            monkeypatch.setenv(name, value)
        kube.store.create(MUTATING_WEBHOOKS, None, configuration())
        yield kube


def settings(directory: Path) -> TlsSettings:
    return TlsSettings(
        cert=directory / "tls.crt",
        key=directory / "tls.key",
        reload_interval_s=30.0,
        self_managed=True,
        secret="spotdrain-webhook-tls",
        configuration=CONFIGURATION,
        service=SERVICE,
        namespace=NAMESPACE,
    )


def ca_bundles(kube: FakeKube) -> list[bytes]:
    stored = kube.store.get(MUTATING_WEBHOOKS, None, CONFIGURATION)
    return [base64.b64decode(hook["clientConfig"]["caBundle"]) for hook in stored["webhooks"]]


async def handshake(tls: TlsSettings, ca: bytes, hostname: str) -> None:
    """A TLS handshake with a server serving ``tls``'s files, verified against ``ca`` as the API server does."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(tls.cert, tls.key)
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_context)
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context(cadata=ca.decode())
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname=hostname)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_two_replicas_starting_together_serve_one_certificate_the_ca_bundle_trusts(
    kube: FakeKube, tmp_path: Path
) -> None:
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE)
    first, second = settings(tmp_path / "a"), settings(tmp_path / "b")
    await asyncio.gather(provision(first, serviceaccount_dir=account), provision(second, serviceaccount_dir=account))
    assert first.cert.read_bytes() == second.cert.read_bytes()
    assert first.key.stat().st_mode & 0o077 == 0
    [ca, other] = ca_bundles(kube)
    assert ca == other
    await handshake(first, ca, f"{SERVICE}.{NAMESPACE}.svc")
    assert len(kube.store.items(SECRETS, NAMESPACE)) == 1


async def test_a_restarted_replica_reuses_the_secret_and_writes_nothing(kube: FakeKube, tmp_path: Path) -> None:
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE)
    await provision(settings(tmp_path / "a"), serviceaccount_dir=account)
    kube.calls.clear()
    again = settings(tmp_path / "b")
    await provision(again, serviceaccount_dir=account)
    assert again.cert.read_bytes() == (tmp_path / "a" / "tls.crt").read_bytes()
    assert {(c.method, c.pattern) for c in kube.calls} == {
        ("GET", "/api/v1/namespaces/{namespace}/secrets/{name}"),
        ("GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}"),
        ("GET", "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"),  # 404: none here
    }


async def test_a_server_error_and_a_configuration_edited_meanwhile_are_retried(kube: FakeKube, tmp_path: Path) -> None:
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE)
    kube.fail_next("GET", "/secrets/", 503)
    kube.fail_next("PATCH", "/mutatingwebhookconfigurations/", 422, message="testing value failed")
    tls = settings(tmp_path / "a")
    await provision(tls, serviceaccount_dir=account)
    await handshake(tls, ca_bundles(kube)[0], f"{SERVICE}.{NAMESPACE}.svc")


async def test_a_lost_race_to_create_the_secret_reads_the_winners(kube: FakeKube, tmp_path: Path) -> None:
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE)
    winner = settings(tmp_path / "winner")
    await provision(winner, serviceaccount_dir=account)
    loser = settings(tmp_path / "loser")
    kube.fail_next("GET", "/secrets/", 404)  # it looked before the winner's Secret was there
    await provision(loser, serviceaccount_dir=account)
    assert kube.count("POST", "/api/v1/namespaces/{namespace}/secrets") == 2  # the second one answered 409
    assert loser.cert.read_bytes() == winner.cert.read_bytes()


async def test_a_secret_that_holds_no_certificate_is_an_error_that_says_what_to_do(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.store.create(SECRETS, NAMESPACE, {"metadata": {"name": "spotdrain-webhook-tls"}, "data": {"x": "eQ=="}})
    with pytest.raises(ProvisionError, match="delete it and restart"):
        await provision(settings(tmp_path / "a"), serviceaccount_dir=kube.serviceaccount_dir(tmp_path / "sa"))


async def test_a_token_without_patch_on_the_configuration_fails_with_the_api_servers_reason(
    kube: FakeKube, tmp_path: Path
) -> None:
    token = kube.issue_token(
        "system:serviceaccount:spotdrain:spotdrain-webhook", denied=[("patch", "mutatingwebhookconfigurations")]
    )
    account = kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE, token=token)
    with pytest.raises(ApiError, match="cannot patch resource"):
        await provision(settings(tmp_path / "a"), serviceaccount_dir=account)


@pytest.mark.parametrize("garbage", [0, 1])  # a proxy's HTML page; an object cut off
async def test_an_answer_that_is_not_json_is_retried_not_raised(kube: FakeKube, tmp_path: Path, garbage: int) -> None:
    kube.faults.inject("garbage", "GET", "/mutatingwebhookconfigurations/", garbage=garbage)
    tls = settings(tmp_path / "a")
    await provision(tls, serviceaccount_dir=kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE))
    assert len(kube.faults.struck) == 1  # the garbage came, and the call was made again
    assert kube.count("GET", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{name}") == 1
    await handshake(tls, ca_bundles(kube)[0], f"{SERVICE}.{NAMESPACE}.svc")


async def test_a_create_whose_answer_was_lost_reads_the_secret_it_made(kube: FakeKube, tmp_path: Path) -> None:
    # The API stored the Secret, then the connection dropped: the retried create is a 409, and the Secret is ours.
    kube.faults.inject("drop", "POST", "/secrets", applied=True)
    tls = settings(tmp_path / "a")
    await provision(tls, serviceaccount_dir=kube.serviceaccount_dir(tmp_path / "sa", namespace=NAMESPACE))
    assert len(kube.faults.struck) == 1
    assert len(kube.store.items(SECRETS, NAMESPACE)) == 1
    await handshake(tls, ca_bundles(kube)[0], f"{SERVICE}.{NAMESPACE}.svc")
