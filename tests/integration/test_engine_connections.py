"""What the kernel says of real connections to a fake vLLM on 127.0.0.1, and which of them hold a drain."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import httpx
import pytest

import sidecar.sockdiag
from gateway.backends import Pool, health_checker
from gateway.metrics import GatewayMetrics
from sidecar.connections import Patience, holding
from sidecar.sockdiag import dump
from simulate.fakes.engine import EngineConfig
from spotdrain.metrics import CollectorRegistry
from tests.conftest import running_engine, until

PATIENCE = Patience(answered_ms=200, tied_ms=400)


def held(port: int) -> dict[str, int]:
    return holding(dump(port, timeout_s=1.0), PATIENCE)[0]


def open_count(port: int) -> int:
    return len(dump(port, timeout_s=1.0))


async def raw_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
    """One keep-alive request on a connection the caller keeps; returns the head and body of its answer."""
    writer.write(request)
    return await answer(reader)


async def answer(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


HEALTH = b"GET /health HTTP/1.1\r\nHost: engine\r\n\r\n"


def completion(max_tokens: int, *, stream: bool = False) -> bytes:
    body = json.dumps({"prompt": "hello", "max_tokens": max_tokens, "stream": stream}).encode()
    return b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n" + (
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )


async def test_pooled_connections_of_aiohttp_httpx_and_a_long_held_one_stop_holding_once_answered() -> None:
    async with running_engine(EngineConfig(tokens_per_s=100)) as port:
        url = f"http://127.0.0.1:{port}"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # held open for the whole test
        async with aiohttp.ClientSession() as pooled, httpx.AsyncClient() as other:
            assert b"200 OK" in await raw_request(reader, writer, HEALTH)
            body = {"prompt": "hi", "max_tokens": 40, "stream": True}
            async with pooled.post(f"{url}/v1/completions", json=body) as response:
                async with other.stream("POST", f"{url}/v1/completions", json=body) as streamed:
                    assert held(port)  # both streams are still sending
                    async for _ in streamed.aiter_lines():
                        pass
                await response.read()
            assert open_count(port) == 3, "the pools keep their connections, and the raw one stays"
            await until(lambda: not held(port), timeout_s=PATIENCE.answered_ms / 1000 + 0.5)
            assert open_count(port) == 3
        writer.close()
        await writer.wait_closed()


async def test_a_request_not_yet_answered_holds_on_a_fresh_and_on_a_reused_connection() -> None:
    async with running_engine(EngineConfig(tokens_per_s=50)) as port:
        fresh = await asyncio.open_connection("127.0.0.1", port)
        reused = await asyncio.open_connection("127.0.0.1", port)
        await raw_request(*reused, HEALTH)
        await until(lambda: not held(port), timeout_s=2)
        # Non-streamed: nothing goes out until the whole completion is done, 40 tokens at 50 per second.
        for _, writer in (fresh, reused):
            writer.write(completion(40))  # into the kernel at once: loopback delivers it within the call
        answers = [asyncio.create_task(answer(reader)) for reader, _ in (fresh, reused)]
        seen = []
        while not all(task.done() for task in answers):
            seen.append(sum(held(port).values()))
            await asyncio.sleep(0.05)
        assert min(seen[:-1]) == 2, f"each unanswered request held at every look: {seen}"
        assert all(b"200 OK" in task.result() for task in answers)
        await until(lambda: not held(port), timeout_s=2)
        for _, writer in (fresh, reused):
            writer.close()


async def test_bytes_the_client_does_not_read_hold_until_it_reads_them() -> None:
    async with running_engine(EngineConfig(tokens_per_s=2000)) as port:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(completion(200, stream=True))  # some 50 KB of events, far more than the buffer holds
        await asyncio.sleep(1)  # the client reads nothing: the engine's writes fill the buffers, and wait
        assert held(port) == {"bytes queued": 1}
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        while b"[DONE]" not in await loop.sock_recv(sock, 65536):
            pass
        await until(lambda: not held(port), timeout_s=2)
        sock.close()


def _unprivileged_python() -> str | None:
    for python in (sys.executable, "/usr/bin/python3"):
        probe = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c", "print(1)"]
        if subprocess.run(probe, capture_output=True, check=False).returncode == 0:
            return python
    return None


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to become nobody")
async def test_the_dump_works_for_an_unprivileged_user() -> None:
    python = _unprivileged_python()
    if python is None:
        pytest.skip("no Python this machine lets the user nobody run")
    with tempfile.TemporaryDirectory() as directory:  # pytest's own are closed to other users
        os.chmod(directory, 0o755)
        shutil.copy(Path(sidecar.sockdiag.__file__), Path(directory) / "sockdiag.py")
        done = await _dump_as_nobody(python, Path(directory))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("TcpConn(") == 1, done.stdout
    assert "last_sent_ms=None" not in done.stdout, "the kernel gave nobody the tcp_info"


async def _dump_as_nobody(python: str, directory: Path) -> subprocess.CompletedProcess[str]:
    """The sockets of a fake engine with one pooled connection, dumped by the user nobody."""
    async with running_engine(EngineConfig()) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await raw_request(reader, writer, HEALTH)
        script = f"import sys; sys.path.insert(0, {str(directory)!r}); import sockdiag; "
        script += f"print(sockdiag.dump({port}, timeout_s=2))"
        command = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c", script]
        done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, check=False)
        writer.close()
    return done


async def test_the_gateways_health_checks_leave_no_connection_open_on_the_engine_port() -> None:
    async with running_engine(EngineConfig()) as port:
        pool = Pool([f"http://127.0.0.1:{port}"], GatewayMetrics.create(CollectorRegistry()))
        checking = asyncio.create_task(health_checker(pool, interval_s=0.05, timeout_s=1))
        await until(lambda: pool.any_ready(), timeout_s=5)
        looks = []
        for _ in range(20):
            await asyncio.sleep(0.03)
            looks.append(open_count(port))
        checking.cancel()
        assert max(looks) <= 1, f"connections open at each look: {looks}"
        assert looks.count(0) >= 15, f"connections open at each look: {looks}"
