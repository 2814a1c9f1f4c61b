"""A throwaway certificate authority and server certificate for fakes that speak HTTPS on 127.0.0.1.

Clients verify the server as they would a real one: the CA goes into a kubeconfig's ``certificate-authority`` or a
service account's ``ca.crt``, and the server certificate names ``127.0.0.1`` and ``localhost``.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from spotdrain.certificates import make_bundle


@dataclass(frozen=True)
class TlsFiles:
    ca_path: Path
    cert_path: Path
    key_path: Path


def write_tls_files(
    directory: Path,
    *,
    hosts: Sequence[str] = ("127.0.0.1", "localhost"),
    valid_for: timedelta = timedelta(days=7),
) -> TlsFiles:
    """Write ``ca.crt``, ``server.crt`` and ``server.key`` (PEM) into ``directory`` and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    bundle = make_bundle(hosts, now=datetime.now(UTC), valid_for=valid_for)
    files = TlsFiles(directory / "ca.crt", directory / "server.crt", directory / "server.key")
    files.ca_path.write_bytes(bundle.ca_cert)
    files.cert_path.write_bytes(bundle.cert)
    files.key_path.touch(mode=0o600)
    files.key_path.write_bytes(bundle.key)
    return files


def server_ssl_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert_path, files.key_path)
    return context
