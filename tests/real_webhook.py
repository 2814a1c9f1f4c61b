"""``spotdrain webhook``'s app on 127.0.0.1, called by the real API server through the shipped webhook
configurations (deploy/webhook/base), each webhook's ``clientConfig`` pointed at it with its CA."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

from inject.spec import Options
from simulate.fakes.processes import free_port
from simulate.fakes.tls import server_ssl_context, write_tls_files
from spotdrain.kube_rest import InCluster
from spotdrain.metrics import CollectorRegistry
from tests.conftest import RBAC_KINDS
from tests.deploy.manifests import render
from tests.real_kube import RealKube
from webhook.eviction_guard import pod_lookup
from webhook.metrics import WebhookMetrics
from webhook.server import webhook_app

PATHS = {"MutatingWebhookConfiguration": "/mutate", "ValidatingWebhookConfiguration": "/validate-eviction"}


@asynccontextmanager
async def serving_webhook(kube: RealKube, tmp_path: Path, kinds: Collection[str]) -> AsyncIterator[None]:
    """The app with the webhook's rendered grants (the guard reads pods with them), and the configurations of
    ``kinds`` applied; the API server calls it from the block's start (a new configuration applies at once)."""
    rendered = render("deploy/webhook/base")
    token = kube.apply_and_token([o for o in rendered if o["kind"] in RBAC_KINDS], "spotdrain", "spotdrain-webhook")
    account = kube.serviceaccount_dir(tmp_path / "webhook-sa", namespace="spotdrain", token=token)
    (account / "ca.crt").write_bytes(kube.plane.ca_path.read_bytes())
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": kube.plane.url.rpartition(":")[2]}
    tls = write_tls_files(tmp_path / "webhook-tls")
    bundle = base64.b64encode(tls.ca_path.read_bytes()).decode()
    async with aiohttp.ClientSession() as session:
        lookup = pod_lookup(session, InCluster.from_environment(account, env=env))
        metrics = WebhookMetrics.create(CollectorRegistry())
        app = webhook_app(Options(), metrics=metrics, max_body_bytes=1 << 20, read_timeout_s=5, pods=lookup)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port, ssl_context=server_ssl_context(tls)).start()
        try:
            for configuration in (o for o in rendered if o["kind"] in kinds):
                for hook in configuration["webhooks"]:
                    url = f"https://127.0.0.1:{port}{PATHS[configuration['kind']]}"
                    hook["clientConfig"] = {"url": url, "caBundle": bundle}
                kube.admin.apply(configuration)
            yield
        finally:
            await runner.cleanup()
