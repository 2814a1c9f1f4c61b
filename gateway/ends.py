"""How a backend's answer ended, and the events the gateway writes into a client's stream itself."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"
# Why a backend stream ended abnormally; each is a reason to continue elsewhere and a metric label.
# "proactive": the gateway itself moved the stream off a backend whose node is about to be reclaimed; "stalled": off
# a backend going away, on which the stream had gone silent.
CAUSES = ("reset", "timeout", "server_error", "error_event", "abort", "garbage", "unavailable", "proactive", "stalled")


@dataclass(frozen=True)
class Finished:
    """The backend sent a ``finish_reason`` and then ``[DONE]``: the stream is whole."""


@dataclass(frozen=True)
class Broken:
    cause: str
    detail: str = ""


End = Finished | Broken


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_event(message: str, *, code: int = 503, kind: str = "ServiceUnavailableError") -> bytes:
    """An OpenAI-style error event, in the shape vLLM streams its own errors."""
    return sse({"error": {"message": message, "type": kind, "param": None, "code": code}})
