"""The certificates of the end-to-end tier's real node: one CA, the API server's serving certificate and the client
certificates its components present, and kubeconfigs that use them.

Kubernetes takes a client certificate's CN as the user and each O as a group ("Authenticating", X509 client
certificates): the Node authorizer admits a kubelet as ``CN=system:node:NAME, O=system:nodes``, and the default RBAC
bindings name ``system:kube-scheduler`` and ``system:kube-controller-manager`` as users.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from spotdrain.certificates import _general_name

VALID_FOR = timedelta(days=2)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


class Authority:
    """A CA in ``directory`` (``ca.crt``) that signs the certificates asked of it into the same directory."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spotdrain e2e CA")])
        self.now = datetime.now(UTC)
        ca = (
            self._builder(self._name, self._key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.ca_path = directory / "ca.crt"
        self.ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def serving(self, name: str, hosts: Sequence[str]) -> KeyPair:
        """A serving certificate for ``hosts`` (IP addresses or DNS names)."""
        names = x509.SubjectAlternativeName([_general_name(host) for host in hosts])
        return self._issue(name, hosts[0], (), ExtendedKeyUsageOID.SERVER_AUTH, names)

    def client(self, name: str, user: str, groups: Sequence[str] = ()) -> KeyPair:
        """A client certificate for ``user`` in ``groups``."""
        return self._issue(name, user, groups, ExtendedKeyUsageOID.CLIENT_AUTH, None)

    def kubeconfig(self, path: Path, server: str, pair: KeyPair) -> Path:
        """A kubeconfig (JSON, which YAML readers take) for ``server`` with the client certificate ``pair``."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": str(self.ca_path)}}],
            "users": [{"name": "e2e", "user": {"client-certificate": str(pair.cert), "client-key": str(pair.key)}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}],
            "current-context": "e2e",
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    def _issue(
        self,
        name: str,
        common_name: str,
        groups: Sequence[str],
        usage: x509.ObjectIdentifier,
        names: x509.SubjectAlternativeName | None,
    ) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group) for group in groups]
        subject = x509.Name([*attributes, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        builder = self._builder(subject, key.public_key()).add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if names is not None:
            builder = builder.add_extension(names, critical=False)
        pair = KeyPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        pair.key.touch(mode=0o600)
        pem = serialization.Encoding.PEM
        pair.key.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        return pair

    def _builder(self, subject: x509.Name, public: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(self.now - timedelta(minutes=5))
            .not_valid_after(self.now + VALID_FOR)
        )
