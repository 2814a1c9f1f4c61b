"""How ``spotdrain check`` reaches the API server: ``--kubeconfig`` (or ``$KUBECONFIG``), the pod's service account,
or ``~/.kube/config``, in the order the node agent uses (agent/drain/kube_config.py).

A kubeconfig is read with kubernetes-asyncio's loader, which knows every way a kubeconfig names its user (tokens,
client certificates, ``exec`` plugins such as ``aws eks get-token``); the calls themselves go through
``spotdrain.kube_rest``, the plain aiohttp client the other programs use.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from agent.drain.kube_config import TOKEN, api_source
from spotdrain.kube_rest import Access, InCluster
from spotdrain.settings import SettingsError


@dataclass(frozen=True)
class Kubeconfig:
    """A kubeconfig's current context, as kubernetes-asyncio's loader resolved it."""

    base_url: str
    authorization: str | None
    ca_path: str | None
    cert_path: str | None
    key_path: str | None
    verify: bool

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_path)
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if self.cert_path:
            context.load_cert_chain(self.cert_path, self.key_path)
        return context

    def headers(self) -> dict[str, str]:
        return {"Authorization": self.authorization} if self.authorization else {}


async def load(kubeconfig: str | None, *, context: str | None = None) -> Access:
    """The API server to read, or SettingsError saying why there is none."""
    source = api_source(kubeconfig, env=os.environ, home=Path.home())
    if source.kind == "in-cluster":
        cluster = InCluster.from_environment(TOKEN.parent)
        if missing := cluster.missing():
            raise SettingsError(f"in a cluster, but {', '.join(missing)} missing")
        return cluster
    from kubernetes_asyncio import config
    from kubernetes_asyncio.client import Configuration

    settings = Configuration()
    try:
        await config.load_kube_config(config_file=source.path, context=context, client_configuration=settings)
    except Exception as error:  # the loader raises ConfigException, OSError, YAML errors... all mean the same here
        raise SettingsError(f"cannot read {source.describe()}: {error}") from error
    return Kubeconfig(
        base_url=str(settings.host).rstrip("/"),
        authorization=settings.api_key.get("BearerToken"),
        ca_path=settings.ssl_ca_cert,
        cert_path=settings.cert_file,
        key_path=settings.key_file,
        verify=bool(settings.verify_ssl),
    )
