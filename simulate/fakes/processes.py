"""Starting spotdrain's programs and fakes as real processes on 127.0.0.1, for tests, the demo and benchmarks."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import aiohttp

_GIVEN: deque[int] = deque(maxlen=256)


def free_port() -> int:
    """A port free on 127.0.0.1 now, and none of the last ones this process was given: the kernel may give two
    probes in a row the same port, and a program given it twice (metrics and notices) fails to bind the second."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.append(port)
            return port


async def wait_http(url: str, *, timeout_s: float = 10.0, status: int | None = None) -> None:
    """Return once ``url`` answers (with ``status`` if given); raise TimeoutError otherwise."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as response:
                    if status is None or response.status == status:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            if loop.time() > give_up:
                raise TimeoutError(f"{url} did not answer within {timeout_s} s")
            await asyncio.sleep(0.05)


async def status_of(url: str) -> tuple[int, str]:
    """One GET: the status and the body."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def start(
    args: Sequence[str], *, log_path: Path, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """Start ``python -m <args>`` with its output in ``log_path``."""
    with log_path.open("ab") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            *args,
            stdout=log,
            stderr=log,
            stdin=asyncio.subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )


async def stop(process: asyncio.subprocess.Process, *, within_s: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited ``within_s`` seconds later; returns once it has exited."""
    if process.returncode is None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), within_s)
        except TimeoutError:
            process.kill()
            await process.wait()


def engine_args(port: int, *extra: str) -> list[str]:
    return ["-m", "simulate.fakes.engine", "--port", str(port), *extra]


def sidecar_args(*, port: int, engine_port: int, drain_dir: Path, extra: Sequence[str] = ()) -> list[str]:
    return [
        "-m",
        "spotdrain.cli",
        "--log-format",
        "json",
        "sidecar",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--engine-url",
        f"http://127.0.0.1:{engine_port}",
        "--drain-dir",
        str(drain_dir),
        *extra,
    ]


async def stream(port: int, *, max_tokens: int, prompt: str = "hello") -> list[str]:
    """Run one streamed completion to its end; returns the token texts, then ``[DONE]`` if the stream finished."""
    pieces: list[str] = []
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": prompt, "max_tokens": max_tokens, "stream": True},
        ) as response,
    ):
        try:
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    pieces.append(data)
                else:
                    pieces.append(json.loads(data)["choices"][0]["text"])
        except aiohttp.ClientPayloadError:
            pass  # the engine went away mid-stream: the caller sees no [DONE]
    return pieces
