"""Flags that also read ``SPOTDRAIN_<FLAG>`` variables, the value types they accept, and the settings error.

Each program keeps its own frozen settings dataclasses; this module only supplies the parts they share.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import structlog

log = structlog.get_logger()


class SettingsError(ValueError):
    """A flag or variable has a value the program cannot run with; the message says which and why."""


def env_name(flag: str) -> str:
    """``--poll-interval`` reads ``SPOTDRAIN_POLL_INTERVAL``."""
    return "SPOTDRAIN_" + flag.lstrip("-").replace("-", "_").upper()


def seconds(text: str) -> float:
    """A duration in seconds: a non-negative finite number, fractions allowed (``0.2``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative number of seconds")
    return value


def port(text: str) -> int:
    """A TCP port, 1 to 65535 (0 asks the kernel for a free one, which tests use)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is outside 0-65535")
    return value


def positive_int(text: str) -> int:
    """A whole number, at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def http_url(text: str) -> str:
    """An absolute http(s) URL without a trailing slash."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return text.rstrip("/")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def _from_env(flag: str, convert: Callable[[str], Any], env: Mapping[str, str], aliases: tuple[str, ...]) -> Any:
    for name in (env_name(flag), *aliases):
        raw = env.get(name)
        if raw is None:
            continue
        try:
            return convert(raw)
        except (argparse.ArgumentTypeError, ValueError) as error:
            raise SettingsError(f"{name}={raw!r}: {error}") from None
    return None


def add_flag(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    convert: Callable[[str], Any] = str,
    default: Any = None,
    help: str,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] | None = None,
    env: Mapping[str, str] | None = None,
    default_help: str | None = None,
) -> None:
    """Add ``flag``; its default comes from ``SPOTDRAIN_<FLAG>`` (or an alias variable) when set.

    ``default_help`` says what the default is where ``default`` alone cannot (one that depends on another flag).
    """
    from_env = _from_env(flag, convert, os.environ if env is None else env, aliases)
    if choices is not None and from_env is not None and from_env not in choices:
        raise SettingsError(f"{env_name(flag)}={from_env!r}: choose from {', '.join(choices)}")
    variables = ", ".join((env_name(flag), *aliases))
    parser.add_argument(
        flag,
        type=convert,
        default=default if from_env is None else from_env,
        choices=choices,
        help=f"{help} (env {variables}; default: {default if default_help is None else default_help})",
    )


def add_kubeconfig_flag(parser: argparse.ArgumentParser) -> None:
    """``--kubeconfig`` (or ``KUBECONFIG``), as every program that talks to the Kubernetes API takes it."""
    add_flag(
        parser,
        "--kubeconfig",
        aliases=("KUBECONFIG",),
        help="kubeconfig file",
        default_help="the in-cluster service account, else ~/.kube/config",
    )


def add_switch(
    parser: argparse.ArgumentParser,
    flag: str,
    *,
    default: bool,
    help: str,
    env: Mapping[str, str] | None = None,
) -> None:
    """Add ``--flag/--no-flag``; ``SPOTDRAIN_<FLAG>=true|false`` sets the default."""
    from_env = _from_env(flag, boolean, os.environ if env is None else env, ())
    parser.add_argument(
        flag,
        action=argparse.BooleanOptionalAction,
        default=default if from_env is None else from_env,
        help=f"{help} (env {env_name(flag)}; default: {default})",
    )


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SettingsError(message)


def plain(settings: Any) -> dict[str, Any]:
    """A settings dataclass as plain data for logs and JSON: nested dicts, paths as strings."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        return {key: str(value) if isinstance(value, os.PathLike) else value for key, value in items}

    return dataclasses.asdict(settings, dict_factory=pairs)


def log_effective(program: str, settings: Any) -> None:
    """Log the whole effective configuration once, at start."""
    log.info("settings.effective", program=program, **plain(settings))
