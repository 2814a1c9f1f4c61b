"""A certificate authority of its own and one serving certificate it signs, made with ``cryptography``: what the
self-managed webhook serves (its CA goes into the configuration's ``caBundle``, nowhere else), and what the fakes
that speak HTTPS on 127.0.0.1 serve.

Pure: PEM out, kept by the caller. The CA's key is not returned: the CA signs the one certificate and nothing
else, ever. ``cryptography`` is the webhook extra's (and a test dependency): only the programs that make
certificates import this module.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = timedelta(days=3650)
BACKDATE = timedelta(hours=1)  # an API server whose clock runs a little behind still accepts it


@dataclass(frozen=True)
class Bundle:
    """PEM bytes: the CA's certificate (the caBundle) and the serving certificate and key (the server's)."""

    ca_cert: bytes
    cert: bytes
    key: bytes

    def expires(self) -> datetime:
        return x509.load_pem_x509_certificate(self.cert).not_valid_after_utc

    def names(self) -> set[str]:
        certificate = x509.load_pem_x509_certificate(self.cert)
        alternative = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return {str(name) for name in alternative.get_values_for_type(x509.DNSName)}


def make_bundle(hosts: Sequence[str], *, now: datetime, valid_for: timedelta = VALID_FOR) -> Bundle:
    """A new CA, and a serving certificate it signs for ``hosts`` (DNS names or IP addresses)."""
    start, end = now - BACKDATE, now + valid_for
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spotdrain webhook CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    cert = (
        _builder(subject, ca_name, key.public_key(), start, end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([_general_name(host) for host in hosts]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return Bundle(ca.public_bytes(pem), cert.public_bytes(pem), private)


def _builder(
    subject: x509.Name, issuer: x509.Name, public: ec.EllipticCurvePublicKey, start: datetime, end: datetime
) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )


def _usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
