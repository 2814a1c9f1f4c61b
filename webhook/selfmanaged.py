"""Self-managed TLS: the webhook's replicas share one CA and serving certificate, kept in a Secret, and set the
CA as the configuration's ``caBundle`` at start.

The first replica to start makes them and creates the Secret; a replica that finds it (or loses the race to
create it, 409) uses what is there, so every replica serves a certificate the one caBundle trusts. The CA's key
is discarded once the serving certificate is signed: nothing else can ever be signed with a CA the API server
trusts for this webhook. The certificate is valid ten years; to renew, delete the Secret and restart the webhook.
"""

from __future__ import annotations

import base64
import binascii
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from spotdrain.certificates import Bundle, make_bundle
from spotdrain.clock import utcnow
from spotdrain.kube_rest import SERVICEACCOUNT_DIR, InCluster, call
from spotdrain.retry import ApiError, retrying
from webhook.settings import TlsSettings

log = structlog.get_logger()

JSON_PATCH = "application/json-patch+json"
CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
# The eviction guard's configuration, of the same name; a cluster where it is not installed has none to trust.
GUARD_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
Obj = dict[str, Any]


class ProvisionError(Exception):
    """The certificate cannot be had or trusted; the message says what to do."""


def service_names(service: str, namespace: str) -> list[str]:
    """The names the API server may use for the Service: it calls ``<service>.<namespace>.svc``."""
    base = f"{service}.{namespace}"
    return [f"{base}.svc", f"{base}.svc.cluster.local", base, service]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def secret_object(name: str, namespace: str, bundle: Bundle) -> Obj:
    data = {"ca.crt": bundle.ca_cert, "tls.crt": bundle.cert, "tls.key": bundle.key}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/name": "spotdrain-webhook"}},
        "type": "kubernetes.io/tls",
        "data": {key: _b64(value) for key, value in data.items()},
    }


def bundle_of(secret: Obj) -> Bundle | None:
    """The bundle a Secret holds; None when it lacks a part or a part is not base64."""
    data = secret.get("data")
    if not isinstance(data, dict):
        return None
    try:
        parts = [base64.b64decode(data[key], validate=True) for key in ("ca.crt", "tls.crt", "tls.key")]
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None
    return Bundle(*parts)


def ca_patch(configuration: Obj, ca_cert: bytes) -> list[Obj]:
    """The JSON patch that sets ``caBundle`` on every webhook of the configuration that lacks it; each guarded by
    a test of the webhook's name, so a list reordered since it was read fails (422) rather than patch another."""
    operations: list[Obj] = []
    for index, webhook in enumerate(configuration.get("webhooks") or []):
        if (webhook.get("clientConfig") or {}).get("caBundle") == _b64(ca_cert):
            continue
        operations.append({"op": "test", "path": f"/webhooks/{index}/name", "value": webhook.get("name")})
        operations.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": _b64(ca_cert)})
    return operations


def check(bundle: Bundle | None, tls: TlsSettings, now: datetime) -> Bundle:
    where = f"Secret {tls.namespace}/{tls.secret}"
    if bundle is None:
        raise ProvisionError(f"{where} holds no ca.crt, tls.crt and tls.key; delete it and restart the webhook")
    wanted = set(service_names(tls.service, str(tls.namespace)))
    if not wanted <= bundle.names():
        raise ProvisionError(f"{where} is not for Service {tls.service}; delete it and restart the webhook")
    if bundle.expires() <= now:
        raise ProvisionError(f"{where} holds a certificate that expired; delete it and restart the webhook")
    return bundle


async def shared_bundle(session: aiohttp.ClientSession, cluster: InCluster, tls: TlsSettings) -> Bundle:
    """The Secret's bundle; made and stored first if there is none."""
    namespace = str(tls.namespace)
    secrets = f"/api/v1/namespaces/{namespace}/secrets"
    try:
        secret = await retrying(lambda: call(session, cluster, "GET", f"{secrets}/{tls.secret}"), what="tls.secret")
    except ApiError as error:
        if error.status != 404:
            raise
        made = make_bundle(service_names(tls.service, namespace), now=utcnow())
        try:
            body = secret_object(tls.secret, namespace, made)
            await retrying(lambda: call(session, cluster, "POST", secrets, body), what="tls.secret", retry_if=_not_409)
            log.info("webhook.tls_made", secret=tls.secret, expires=made.expires().isoformat())
            return made
        except ApiError as lost:
            if lost.status != 409:
                raise
        secret = await retrying(lambda: call(session, cluster, "GET", f"{secrets}/{tls.secret}"), what="tls.secret")
    return check(bundle_of(secret), tls, utcnow())


def _not_409(error: ApiError) -> bool:
    return error.transient and error.status != 409  # another replica made it: read theirs


async def trust(
    session: aiohttp.ClientSession,
    cluster: InCluster,
    configuration: str,
    ca_cert: bytes,
    *,
    kind: str = CONFIGURATIONS,
) -> None:
    """Set the CA as the caBundle of every webhook of the configuration; a configuration edited meanwhile (422 on
    a test) is read again."""
    path = f"{kind}/{configuration}"

    async def once() -> None:
        current = await call(session, cluster, "GET", path)
        operations = ca_patch(current, ca_cert)
        if operations:
            await call(session, cluster, "PATCH", path, operations, content_type=JSON_PATCH)

    await retrying(once, what="tls.ca_bundle", retry_if=lambda error: error.transient or error.status == 422)
    log.info("webhook.ca_bundle_set", configuration=configuration)


def write(bundle: Bundle, tls: TlsSettings) -> None:
    for path in (tls.cert, tls.key):
        path.parent.mkdir(parents=True, exist_ok=True)
    tls.cert.write_bytes(bundle.cert)
    descriptor = os.open(tls.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(bundle.key)


async def provision(tls: TlsSettings, *, serviceaccount_dir: Path = SERVICEACCOUNT_DIR) -> None:
    """Have the shared certificate, write it where the server loads it, and have the API server trust its CA.
    Raises ProvisionError, or ApiError once the retries for an API call are used up."""
    cluster = InCluster.from_environment(serviceaccount_dir)
    async with aiohttp.ClientSession() as session:
        bundle = await shared_bundle(session, cluster, tls)
        write(bundle, tls)
        await trust(session, cluster, tls.configuration, bundle.ca_cert)
        try:
            await trust(session, cluster, tls.configuration, bundle.ca_cert, kind=GUARD_CONFIGURATIONS)
        except ApiError as error:
            if error.status != 404:
                raise
            log.info("webhook.no_eviction_guard", configuration=tls.configuration)
