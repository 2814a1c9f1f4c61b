"""``spotdrain webhook``: serve ``POST /mutate``, ``POST /validate-eviction`` (``webhook.eviction_guard``) and
``GET /healthz`` over HTTPS, and ``/metrics`` over plain HTTP
on a port of its own (Prometheus scrapes it without the webhook's CA), until SIGTERM.

The answer is ``webhook.admission``'s; this module reads the body (bounded in size and time), logs and counts what
was done, and never lets an unforeseen error deny a Pod: the API server is told to admit it unchanged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from inject.spec import Options
from spotdrain.kube_rest import SERVICEACCOUNT_DIR
from spotdrain.metrics import CollectorRegistry
from spotdrain.probes import probe_app, serve
from spotdrain.retry import ApiError
from spotdrain.settings import SettingsError, log_effective
from spotdrain.tasks import Role, Supervisor, on_signals
from webhook.admission import BadReview, answer, mutate, parse
from webhook.eviction_guard import PodLookup, in_cluster, judge, pod_lookup
from webhook.metrics import WebhookMetrics, outcome_of
from webhook.settings import WebhookSettings, from_arguments

log = structlog.get_logger()


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(body).encode(), content_type="application/json")


async def _read(request: web.Request, timeout_s: float) -> bytes:
    async with asyncio.timeout(timeout_s):
        return await request.read()


def _pod_name(request: dict[str, Any]) -> str | None:
    """The Pod's name, or its generateName (a ReplicaSet's pods have no name yet at admission)."""
    pod = request.get("object")
    metadata = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(metadata, dict):
        return None
    name = metadata.get("name") or metadata.get("generateName")
    return str(name) if name else None


def webhook_app(
    options: Options,
    *,
    metrics: WebhookMetrics,
    max_body_bytes: int,
    read_timeout_s: float,
    pods: PodLookup | None = None,
) -> web.Application:
    """The app: ``/mutate`` answers AdmissionReviews (4xx for anything else), ``/validate-eviction`` judges an
    agent's eviction with ``pods`` (None: every one is denied), ``/healthz`` says ok; each answer of ``/mutate`` is
    counted by outcome and timed."""

    async def mutate_handler(request: web.Request) -> web.Response:
        started = time.perf_counter()
        outcome = "bad_request"  # until an answer says otherwise: a 413 from the body's read is one too
        try:
            response, outcome = await admit(request)
            return response
        finally:
            metrics.admissions.labels(outcome=outcome).inc()
            metrics.duration.observe(time.perf_counter() - started)

    async def admit(request: web.Request) -> tuple[web.Response, str]:
        try:
            body = await _read(request, read_timeout_s)
            review = parse(body)
        except TimeoutError:
            log.warning("webhook.bad_request", reason="body not read in time")
            return _json({"error": "request body not read in time"}, status=408), "bad_request"
        except BadReview as error:
            log.warning("webhook.bad_request", reason=str(error))
            return _json({"error": str(error)}, status=400), "bad_request"
        uid = review["uid"]
        try:
            patch, warnings = mutate(review, options)
        except Exception:  # a Pod shape no rule foresaw: admitted as it came, never denied
            log.exception("webhook.mutate_failed", uid=uid)
            patch, warnings = [], ["spotdrain: the sidecar was not added: the webhook could not read this Pod"]
        log.info(
            "webhook.admitted",
            uid=uid,
            namespace=review.get("namespace"),
            pod=_pod_name(review),
            injected=bool(patch),
            warnings=warnings,
        )
        return _json(answer(uid, patch=patch, warnings=warnings)), outcome_of(patch, warnings)

    async def guard_handler(request: web.Request) -> web.Response:
        try:
            review = parse(await _read(request, read_timeout_s))
        except TimeoutError:
            return _json({"error": "request body not read in time"}, status=408)
        except BadReview as error:
            return _json({"error": str(error)}, status=400)
        return _json(await judge(review, pods))

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post("/mutate", mutate_handler)
    app.router.add_post("/validate-eviction", guard_handler)
    app.router.add_get("/healthz", healthz)
    return app


async def _serving() -> tuple[bool, str]:
    return True, "ok"  # the metrics port answers only while the process runs; /healthz is what the probes ask


def ssl_context(settings: WebhookSettings) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.tls.cert, settings.tls.key)
    return context


async def certificate_reloader(context: ssl.SSLContext, cert: Path, key: Path, *, interval_s: float) -> None:
    """Load the certificate and key again whenever their files change (cert-manager renews them in the Secret the
    kubelet keeps mounted), so new connections get the new one; runs until cancelled. A pair that does not load
    (the kubelet mid-update, a key that is not the certificate's) keeps the old one and is tried again later."""
    loaded = (cert.read_bytes(), key.read_bytes())
    while True:
        await asyncio.sleep(interval_s)
        try:
            current = (cert.read_bytes(), key.read_bytes())
            if current != loaded:
                context.load_cert_chain(cert, key)
                loaded = current
                log.info("webhook.certificate_reloaded", cert=str(cert))
        except (OSError, ssl.SSLError) as error:
            log.warning("webhook.certificate_reload_failed", error=str(error))


async def run(settings: WebhookSettings, *, ready_flag: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit code."""
    log_effective("webhook", settings)
    if settings.tls.self_managed:
        from webhook.selfmanaged import ProvisionError, provision

        try:
            await provision(settings.tls)
        except (ProvisionError, ApiError, SettingsError) as error:
            log.error("webhook.tls_failed", error=str(error))
            return 1
    stop = asyncio.Event()
    on_signals(lambda sig: stop.set(), signal.SIGTERM, signal.SIGINT)
    registry = CollectorRegistry()
    metrics = WebhookMetrics.create(registry)
    async with aiohttp.ClientSession() as session:
        cluster = in_cluster(SERVICEACCOUNT_DIR)
        app = webhook_app(
            settings.inject,
            metrics=metrics,
            max_body_bytes=settings.max_body_bytes,
            read_timeout_s=settings.read_timeout_s,
            pods=pod_lookup(session, cluster) if cluster else None,
        )
        return await _serve(app, settings, registry, stop, ready_flag)


async def _serve(
    app: web.Application,
    settings: WebhookSettings,
    registry: CollectorRegistry,
    stop: asyncio.Event,
    ready_flag: asyncio.Event | None,
) -> int:
    context = ssl_context(settings)
    tls = settings.tls
    server = serve(
        app, host=settings.host, port=settings.port, ready_flag=ready_flag, name="webhook", ssl_context=context
    )
    metrics_app = probe_app(registry, ready=_serving)
    roles: list[Role] = [
        ("webhook_server", server),
        ("metrics_server", serve(metrics_app, host=settings.host, port=settings.metrics_port, name="metrics")),
        (
            "certificate_reloader",
            certificate_reloader(context, tls.cert, tls.key, interval_s=tls.reload_interval_s),
        ),
    ]
    return 0 if await Supervisor(stop).run(roles) else 1


def main(args: argparse.Namespace) -> int:
    return asyncio.run(run(from_arguments(args)))
