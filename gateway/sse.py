"""Server-sent events from a backend, parsed incrementally from whatever byte blocks the socket hands over.

Follows the WHATWG event-stream rules the engines rely on: lines end in LF, CRLF or CR; ``data:`` lines (one optional
space after the colon) accumulate into one event; a blank line dispatches it; comment lines (``:``) and other
fields are ignored. Data stays bytes (``json.loads`` reads bytes), so nothing is decoded twice.
"""

from __future__ import annotations

_FIELDS = (b":", b"event:", b"id:", b"retry:", b"event", b"id", b"retry")


class EventTooLarge(ValueError):
    """A line or an event grew past the limit without ending: not an event stream we can relay."""


class SseParser:
    __slots__ = ("_data", "_partial", "_size", "junk", "max_event_bytes")

    def __init__(self, *, max_event_bytes: int = 1 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._partial = b""  # an unfinished line
        self._data: list[bytes] = []  # data lines of the event being read
        self._size = 0
        self.junk = 0  # lines that are no event-stream field: a sign the backend is not speaking SSE

    def feed(self, block: bytes) -> list[bytes]:
        """The events ``block`` completes, in order; raises EventTooLarge past the limit."""
        if not self._partial and not self._data and (whole := self._whole_events(block)) is not None:
            return whole
        text = self._partial + block
        # A CR at the very end may be the first half of a CRLF split across blocks: keep it for the next block.
        held = text.endswith(b"\r")
        if held:
            text = text[:-1]
        if b"\r" in text:
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = text.split(b"\n")
        self._partial = lines.pop() + (b"\r" if held else b"")
        if len(self._partial) > self.max_event_bytes:
            raise EventTooLarge(f"a line longer than {self.max_event_bytes} bytes")
        events: list[bytes] = []
        for line in lines:
            self._line(line, events)
        return events

    def _whole_events(self, block: bytes) -> list[bytes] | None:
        """The events of a block that is whole events, each one ``data: `` line ended by a blank one, as an engine
        writes them; None for any other block. Taken at once: most reads are one such event."""
        if not block.startswith(b"data: ") or not block.endswith(b"\n\n") or len(block) > self.max_event_bytes:
            return None
        events = block[6:-2].split(b"\n\ndata: ")
        if block.count(b"\n") != 2 * len(events) or b"\r" in block:  # a line besides those
            return None
        return events

    @property
    def idle(self) -> bool:
        """Between events: no line or event begun."""
        return not self._partial and not self._data

    def close(self) -> list[bytes]:
        """The events a CR held back at the end completes, once the stream has ended."""
        return self.feed(b"\n") if self._partial.endswith(b"\r") else []

    def _line(self, line: bytes, events: list[bytes]) -> None:
        if not line:
            if self._data:
                events.append(b"\n".join(self._data))
                self._data, self._size = [], 0
            return
        if line.startswith(b"data:") or line == b"data":
            value = line[6:] if line.startswith(b"data: ") else line[5:]
            self._size += len(value) + 1
            if self._size > self.max_event_bytes:
                raise EventTooLarge(f"an event larger than {self.max_event_bytes} bytes")
            self._data.append(value)
        elif not line.startswith(_FIELDS):
            self.junk += 1
