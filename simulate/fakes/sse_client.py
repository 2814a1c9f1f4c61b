"""A client that reads a whole streamed completion and keeps everything a test or a benchmark asserts on."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Streamed:
    status: int
    chunks: list[dict[str, Any]] = field(default_factory=list)  # every JSON event, in order
    comments: list[str] = field(default_factory=list)
    comments_at: list[int] = field(default_factory=list)  # how many JSON events had come before each comment
    done: int = 0  # how many data: [DONE] lines
    cut: bool = False  # the connection ended without [DONE]
    arrivals: list[float] = field(default_factory=list)  # monotonic time of each JSON event
    body: bytes = b""  # the answer when it was not a stream

    @property
    def ended(self) -> bool:
        """Nothing more will come: its ``[DONE]``, its connection's end, or an answer that is not a stream."""
        return bool(self.done) or self.cut or self.status not in (0, 200)

    @property
    def text(self) -> str:
        """The generated text: completions' ``text`` or chat deltas' ``content``, concatenated."""
        parts = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or ():
                parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(parts)

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks for c in chunk.get("choices") or () if c["finish_reason"]]

    @property
    def usage(self) -> list[dict[str, Any]]:
        return [chunk["usage"] for chunk in self.chunks if chunk.get("usage")]

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [chunk["error"] for chunk in self.chunks if "error" in chunk]

    @property
    def roles(self) -> list[str]:
        return [
            c["delta"]["role"]
            for chunk in self.chunks
            for c in chunk.get("choices") or ()
            if "role" in c.get("delta", {})
        ]


def _line(streamed: Streamed, line: str) -> None:
    if line.startswith(":"):
        streamed.comments_at.append(len(streamed.chunks))
        streamed.comments.append(line)
    elif line == "data: [DONE]":
        streamed.done += 1
    elif line.startswith("data: "):
        streamed.chunks.append(json.loads(line.removeprefix("data: ")))
        streamed.arrivals.append(time.monotonic())


async def read_stream(
    url: str,
    body: dict[str, Any],
    *,
    session: aiohttp.ClientSession,
    headers: dict[str, str] | None = None,
    into: Streamed | None = None,
) -> Streamed:
    """POST ``body`` with ``stream: true`` and read the answer to its end (or to the cut); ``into`` is filled as
    the answer arrives, for a caller that watches a stream's progress."""
    async with session.post(url, json={**body, "stream": True}, headers=headers) as response:
        streamed = into if into is not None else Streamed(0)
        streamed.status = response.status
        if response.status != 200 or not response.content_type.startswith("text/event-stream"):
            streamed.body = await response.read()
            return streamed
        try:
            async for raw in response.content:
                line = raw.decode().rstrip("\r\n")
                if line:
                    _line(streamed, line)
        except aiohttp.ClientPayloadError:
            streamed.cut = True
        if not streamed.done:
            streamed.cut = True
        return streamed
