"""Readiness probes as a kubelet runs them: an HTTP GET (a 200 is ready) or a command (exit 0 is ready).

Each call is one run of the probe, bounded by its timeout (the kubelet's ``timeoutSeconds``, 1 s by default); the
answer is (ready, why), the why as the timeline says it when a pod leaves rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

import aiohttp

Answer = tuple[bool, str]
Probe = Callable[[aiohttp.ClientSession], Awaitable[Answer]]
TIMEOUT_S = 1.0  # a probe's timeoutSeconds by default


def http_probe(url: str, *, timeout_s: float = TIMEOUT_S) -> Probe:
    """``httpGet`` on ``url``: ready on a 200."""
    path = urlsplit(url).path or "/"

    async def probe(session: aiohttp.ClientSession) -> Answer:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as answer:
                body = (await answer.text()).strip()
                return answer.status == 200, f"{path} answers {answer.status}" + (f" ({body})" if body else "")
        except (TimeoutError, aiohttp.ClientError) as error:
            return False, f"{path} unreachable: {type(error).__name__}"

    return probe


async def run_command(command: Sequence[str], *, timeout_s: float | None) -> tuple[int | None, str]:
    """Run ``command`` (for at most ``timeout_s``, None: as long as it takes, or until cancelled); returns its exit
    status (None: killed at the timeout) and the first line it wrote to stderr."""
    process = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout_s):
            _, err = await process.communicate()
    except TimeoutError:
        return None, ""
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
    lines = err.decode(errors="replace").strip().splitlines()
    return process.returncode, lines[0] if lines else ""


def exec_probe(command: Sequence[str], *, timeout_s: float = TIMEOUT_S) -> Probe:
    """``exec`` of ``command`` (the container's own command, here run on this machine): ready on exit 0."""
    text = command[-1] if tuple(command[:2]) == ("/bin/sh", "-c") else shlex.join(command)

    async def probe(_: aiohttp.ClientSession) -> Answer:
        code, _err = await run_command(command, timeout_s=timeout_s)
        return code == 0, f"exec probe `{text}` exits {'(timed out)' if code is None else code}"

    return probe
