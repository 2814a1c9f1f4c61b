"""The webhook's settings: frozen, grouped, loaded once from flags and SPOTDRAIN_* variables."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from inject.options import add_options, options_from
from inject.spec import Options
from spotdrain.settings import add_flag, add_switch, port, positive_int, require, seconds

MAX_BODY_BYTES = 4 * 1024 * 1024  # a Pod is at most what etcd stores (1.5 MiB by default), with room to spare


@dataclass(frozen=True)
class TlsSettings:
    cert: Path
    key: Path
    # Self-managed: the webhook makes its CA and certificate itself (kept in a Secret its replicas share), writes
    # them to cert and key, and puts the CA into the configuration's caBundle.
    reload_interval_s: float  # how often the files are checked for a renewed certificate
    self_managed: bool
    secret: str
    configuration: str
    service: str
    namespace: str | None


@dataclass(frozen=True)
class WebhookSettings:
    host: str
    port: int
    metrics_port: int
    tls: TlsSettings
    inject: Options
    max_body_bytes: int
    read_timeout_s: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="0.0.0.0", help="address for /mutate and /healthz (HTTPS) and /metrics")
    add_flag(parser, "--port", convert=port, default=8443, help="port for /mutate and /healthz (HTTPS)")
    add_flag(parser, "--metrics-port", convert=port, default=9090, help="port for /metrics (plain HTTP)")
    add_flag(parser, "--tls-cert", convert=Path, help="serving certificate (PEM); written there when self-managed")
    add_flag(parser, "--tls-key", convert=Path, help="its private key (PEM); written there when self-managed")
    add_flag(
        parser, "--tls-reload-interval", convert=seconds, default=30.0, help="seconds between checks for a renewed pair"
    )
    add_switch(
        parser,
        "--self-managed-tls",
        default=False,
        help="make the CA and certificate at start, shared through --tls-secret, and set the caBundle",
    )
    add_flag(parser, "--tls-secret", default="spotdrain-webhook-tls", help="Secret holding the self-managed CA")
    add_flag(
        parser,
        "--webhook-configuration",
        default="spotdrain-webhook",
        help="MutatingWebhookConfiguration whose caBundle a self-managed webhook sets",
    )
    add_flag(parser, "--service", default="spotdrain-webhook", help="the webhook's Service (the certificate's name)")
    add_flag(parser, "--namespace", aliases=("POD_NAMESPACE",), help="the webhook's namespace (downward API)")
    add_flag(parser, "--max-body", convert=positive_int, default=MAX_BODY_BYTES, help="largest request body, bytes")
    add_flag(parser, "--read-timeout", convert=seconds, default=5.0, help="seconds to read one request's body")
    add_options(parser)


def from_arguments(args: argparse.Namespace) -> WebhookSettings:
    """Build and validate the settings; raises SettingsError with the flag's name and the reason."""
    require(args.tls_cert is not None and args.tls_key is not None, "--tls-cert and --tls-key are both needed")
    require(args.read_timeout > 0, "--read-timeout must be above 0 seconds")
    require(args.tls_reload_interval > 0, "--tls-reload-interval must be above 0 seconds")
    require(args.metrics_port != args.port, "--metrics-port must differ from --port")
    if args.self_managed_tls:
        require(bool(args.namespace), "--self-managed-tls needs --namespace (or POD_NAMESPACE)")
    tls = TlsSettings(
        cert=args.tls_cert,
        key=args.tls_key,
        reload_interval_s=args.tls_reload_interval,
        self_managed=args.self_managed_tls,
        secret=args.tls_secret,
        configuration=args.webhook_configuration,
        service=args.service,
        namespace=args.namespace or None,
    )
    return WebhookSettings(
        host=args.host,
        port=args.port,
        metrics_port=args.metrics_port,
        tls=tls,
        inject=options_from(args),
        max_body_bytes=args.max_body,
        read_timeout_s=args.read_timeout,
    )
