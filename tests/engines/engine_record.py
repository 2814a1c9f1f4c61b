"""What a real vLLM server was asked and what it sent, recorded inside its own process: an ASGI middleware.

``--middleware tests.engines.engine_record.Recorder`` (vLLM adds a class with ``app.add_middleware``), with
``RECORD_ENV`` naming a directory: each POST's body, once read, and each piece of its answer's body as it is handed
to the server's connection, appended as one JSON line to a file of the server's process there and flushed, so a
server killed with SIGKILL leaves every line written before (tests/engines/cut_proxy.py's ``Recorded`` reads them).
Nothing is held back or changed, the client's disconnect included: a test sees the engine's own tokens without a
proxy in front of the server, which would change how a killed or stopped server's streams end.

Only the standard library: vLLM's Python imports it, with the repository's root on its path.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import IO, Any

RECORD_ENV = "SPOTDRAIN_ENGINE_RECORD"
ROOT = Path(__file__).resolve().parents[2]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Message, Receive, Send], Awaitable[None]]


def recording(directory: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """The arguments and the environment that have a vLLM server record into ``directory``."""
    return ("--middleware", f"{__name__}.{Recorder.__name__}"), {RECORD_ENV: str(directory), "PYTHONPATH": str(ROOT)}


class Recorder:
    def __init__(self, app: App) -> None:
        self.app = app
        self.directory = os.environ.get(RECORD_ENV)
        self.numbers = itertools.count()
        self.file: IO[str] | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if self.directory is None or scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        number, body = next(self.numbers), bytearray()

        async def received() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body", False):
                    self._line({"n": number, "at": time.monotonic(), "path": scope["path"], "body": body})
            return message

        async def sent(message: Message) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                self._line({"n": number, "out": message["body"]})
            await send(message)

        await self.app(scope, received, sent)

    def _line(self, entry: dict[str, Any]) -> None:
        if self.file is None:
            assert self.directory is not None
            self.file = open(os.path.join(self.directory, f"{os.getpid()}.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
        values = {k: bytes(v).decode("latin-1") if isinstance(v, (bytes, bytearray)) else v for k, v in entry.items()}
        self.file.write(json.dumps(values) + "\n")
        self.file.flush()
