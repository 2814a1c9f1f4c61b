"""The sidecar process at default settings: resident memory after start (target under 40 MB) and time from the
last stream ending to its exit (target: vLLM's zero confirmation, 1 s, plus 0.6 s), against the fake engine process."""

from __future__ import annotations

import asyncio
import signal
import statistics
import tempfile
from pathlib import Path

from bench.common import Result, report, rss_mb
from sidecar.engines import ENGINES
from simulate.fakes.processes import engine_args, free_port, sidecar_args, start, stream, wait_http

MEMORY_TARGET_MB = 40.0
# The zero must hold for the engine's reporting lag before the drain ends; 0.6 s for the rest (poll, exit).
EXIT_TARGET_S = ENGINES["vllm"].zero_confirm_s + 0.6
TOKENS_PER_S = 50
# Longer than the default endpoint delay (5 s), so the drain polls while the stream still runs.
STREAM_TOKENS = 300


async def one_drain(workdir: Path) -> tuple[float, float]:
    """Start a pod, stream, SIGTERM; returns (RSS after start in MB, seconds from last stream end to exit)."""
    engine_port, sidecar_port = free_port(), free_port()
    engine = await start(
        engine_args(engine_port, "--tokens-per-second", str(TOKENS_PER_S)), log_path=workdir / "engine.log"
    )
    sidecar = await start(
        sidecar_args(port=sidecar_port, engine_port=engine_port, drain_dir=workdir / "drain"),
        log_path=workdir / "sidecar.log",
    )
    try:
        await wait_http(f"http://127.0.0.1:{sidecar_port}/ready", status=200)
        await asyncio.sleep(0.5)
        rss = rss_mb(sidecar.pid)
        running = asyncio.create_task(stream(engine_port, max_tokens=STREAM_TOKENS))
        await asyncio.sleep(0.2)
        sidecar.send_signal(signal.SIGTERM)
        pieces = await running
        ended = asyncio.get_running_loop().time()
        if pieces[-1:] != ["[DONE]"]:
            raise RuntimeError("the stream was cut")
        await sidecar.wait()
        return rss, asyncio.get_running_loop().time() - ended
    finally:
        for process in (sidecar, engine):
            if process.returncode is None:
                process.kill()
                await process.wait()


async def measure(trials: int = 4) -> list[Result]:
    samples = []
    for index in range(trials):
        with tempfile.TemporaryDirectory(prefix=f"spotdrain-bench-{index}-") as workdir:
            samples.append(await one_drain(Path(workdir)))
    rss = max(s[0] for s in samples)
    exits = [s[1] for s in samples]
    exit_detail = f"{trials} drains at default settings; median {statistics.median(exits):.3f} s"
    return [
        Result.below("sidecar_rss_after_start", rss, "MB", MEMORY_TARGET_MB, f"largest of {trials} starts"),
        Result.below("sidecar_last_stream_to_exit", max(exits), "s", EXIT_TARGET_S, exit_detail),
    ]


if __name__ == "__main__":
    report(asyncio.run(measure()))
