"""The benchmark client's reader (bench/relay_client.py) gives the same verdict however the answer's bytes are cut
into reads and into chunks of the chunked framing, extensions included: exact, with a latency for every event, for
the engine's bytes; a fault for the same with one byte changed.

Run in a process of its own: importing ``bench`` configures logging for a benchmark's standard output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROPERTY = """
import asyncio
from hypothesis import given, settings, strategies as st
from bench.relay_client import Tally, _Stream
from bench.sse_source import chunk

TOKENS = 4
EVENTS = [chunk(i, last=i == TOKENS - 1, ids=False, written_ns=10**9 + i) for i in range(TOKENS)]
BODY = b"".join(EVENTS[:2]) + b": continued\\n\\n" + b"".join(EVENTS[2:]) + b"data: [DONE]\\n\\n"
HEAD = b"HTTP/1.1 200 OK\\r\\nContent-Type: text/event-stream\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n"


class Transport:
    def write(self, data): pass
    def close(self): pass
    def abort(self): pass


def framed(body, sizes, extension):
    out, at, index = [], 0, 0
    while at < len(body):
        size = sizes[index % len(sizes)]
        piece, at, index = body[at : at + size], at + size, index + 1
        out.append(b"%x%s\\r\\n%s\\r\\n" % (len(piece), b";x=1" if extension else b"", piece))
    return b"".join(out) + b"0\\r\\n\\r\\n"


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 600), min_size=1, max_size=8),
    cuts=st.lists(st.integers(1, 300), min_size=1, max_size=8),
    extension=st.booleans(),
    changed=st.one_of(st.none(), st.integers(0, TOKENS - 1)),
)
def check(sizes, cuts, extension, changed):
    body = BODY
    if changed is not None:
        body = BODY.replace(EVENTS[changed], EVENTS[changed].replace(b'"created":1', b'"created":2'))
    answer = HEAD + framed(body, sizes, extension)

    async def read():
        tally = Tally()
        stream = _Stream(b"", TOKENS, tally)
        stream.connection_made(Transport())
        at = index = 0
        while at < len(answer):
            size = cuts[index % len(cuts)]
            stream.data_received(answer[at : at + size])
            at, index = at + size, index + 1
        stream.connection_lost(None)
        return stream.ended.result(), tally

    fault, tally = asyncio.run(read())
    if changed is None:
        assert fault == "" and len(tally.latencies_ms) == TOKENS, (fault, tally)
    else:
        assert fault.startswith(f"event {changed}:"), fault
        assert len(tally.latencies_ms) == TOKENS - 1


check()
print("checked")
"""


def test_the_clients_verdict_does_not_depend_on_how_the_answer_is_cut() -> None:
    done = subprocess.run([sys.executable, "-c", PROPERTY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "checked"
