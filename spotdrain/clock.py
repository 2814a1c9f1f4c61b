"""Time as spotdrain writes it: UTC, RFC 3339, whole seconds unless a fraction matters."""

from __future__ import annotations

from datetime import UTC, datetime


def rfc3339(moment: datetime) -> str:
    """Format an aware datetime as UTC RFC 3339, e.g. ``2026-11-29T10:22:00Z``."""
    utc = moment.astimezone(UTC)
    text = utc.strftime("%Y-%m-%dT%H:%M:%S")
    if utc.microsecond:
        text += f".{utc.microsecond:06d}".rstrip("0")
    return text + "Z"


def parse_rfc3339(text: str) -> datetime:
    """Parse an RFC 3339 timestamp; a missing offset is taken as UTC. Raises ValueError."""
    moment = datetime.fromisoformat(text.strip().replace("z", "Z"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)
