"""``make demo``: one inference pod drained on SIGTERM, on the embedded fake engine, printed as a timeline.

A fake vLLM and a real ``spotdrain sidecar`` run as processes on 127.0.0.1. Streams of different lengths are
opened, the sidecar gets SIGTERM as Kubernetes would send it, and the timeline shows the pod leaving rotation,
each stream finishing intact, ``drained`` being written and the sidecar exiting.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from agent.fakes.processes import engine_args, free_port, sidecar_args, start, stream, wait_http

TOKENS_PER_S = 40
STREAM_TOKENS = (60, 100, 140, 180)
POLL_INTERVAL_S = 0.5


class Timeline:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def at(self) -> float:
        return time.monotonic() - self.t0

    def say(self, what: str) -> float:
        now = self.at()
        print(f"  {now:6.2f} s  {what}", flush=True)
        return now


async def _watch_ready(url: str, timeline: Timeline) -> float:
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url) as response:
                if response.status == 503:
                    return timeline.say(f"sidecar /ready answers 503: {(await response.text()).strip()}")
            await asyncio.sleep(0.02)


async def _watch_file(path: Path, timeline: Timeline) -> float:
    while not path.exists():
        await asyncio.sleep(0.01)
    return timeline.say(f"{path.name} written: the engine's preStop returns, the engine gets SIGTERM")


async def _one_stream(port: int, tokens: int, index: int, timeline: Timeline) -> tuple[bool, float]:
    pieces = await stream(port, max_tokens=tokens)
    intact = pieces[-1:] == ["[DONE]"] and len(pieces) == tokens + 1
    ended = timeline.say(f"stream {index} ({tokens} tokens) {'completed intact' if intact else 'CUT'}")
    return intact, ended


async def demo(workdir: Path) -> bool:
    engine_port, sidecar_port = free_port(), free_port()
    drain_dir = workdir / "drain"
    timeline = Timeline()
    print("spotdrain demo: one inference pod told to terminate while it streams\n")
    engine = await start(
        engine_args(engine_port, "--tokens-per-second", str(TOKENS_PER_S)), log_path=workdir / "engine.log"
    )
    sidecar = await start(
        sidecar_args(
            port=sidecar_port,
            engine_port=engine_port,
            drain_dir=drain_dir,
            extra=["--endpoint-delay", "1", "--poll-interval", str(POLL_INTERVAL_S)],
        ),
        log_path=workdir / "sidecar.log",
    )
    try:
        await wait_http(f"http://127.0.0.1:{sidecar_port}/ready", status=200)
        timeline.say("fake vLLM engine and sidecar up; /ready answers 200, the pod is in rotation")
        streams = [
            asyncio.create_task(_one_stream(engine_port, tokens, i + 1, timeline))
            for i, tokens in enumerate(STREAM_TOKENS)
        ]
        timeline.say(f"{len(streams)} streams open ({', '.join(map(str, STREAM_TOKENS))} tokens at {TOKENS_PER_S}/s)")
        await asyncio.sleep(0.5)
        sigterm_at = timeline.say("SIGTERM to the sidecar (the pod is being deleted)")
        sidecar.send_signal(signal.SIGTERM)
        ready_task = asyncio.create_task(_watch_ready(f"http://127.0.0.1:{sidecar_port}/ready", timeline))
        drained_task = asyncio.create_task(_watch_file(drain_dir / "drained", timeline))
        results = await asyncio.gather(*streams)
        out_of_rotation = await ready_task
        await drained_task
        code = await sidecar.wait()
        exited = timeline.say(f"sidecar exited with code {code}")
    finally:
        for process in (sidecar, engine):
            if process.returncode is None:
                process.terminate()
                await process.wait()
    intact = sum(ok for ok, _ in results)
    last_stream = max(ended for _, ended in results)
    print("\nverdict")
    print(f"  streams completed intact     {intact} of {len(results)}")
    print(f"  SIGTERM to out of rotation   {out_of_rotation - sigterm_at:.2f} s")
    print(f"  last stream to sidecar exit  {exited - last_stream:.2f} s")
    passed = intact == len(results) and code == 0
    print(f"  result                       {'PASS' if passed else 'FAIL'}")
    return passed


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="spotdrain-demo-") as workdir:
        sys.exit(0 if asyncio.run(demo(Path(workdir))) else 1)


if __name__ == "__main__":
    main()
