"""The package as pyproject.toml describes it; with ``SPOTDRAIN_COMPILE=1``, the gateway's relay path compiled too.

``SPOTDRAIN_COMPILE=1 pip wheel --no-build-isolation --no-deps .``, where mypy, setuptools and the gateway's
dependencies are installed and a C compiler is at hand (as in Dockerfile.gateway's build stage), compiles the
modules below with mypyc into C extensions that Python loads in place of their source: a stream's start and end cost
the gateway about a fifth less CPU, and 500 streams of 40 chunks an eighth less (docs/gateway.md, "Compiled").
Without the variable the package is pure Python, as every other image and a development install have it.
"""

from __future__ import annotations

import os

from setuptools import setup

# Every module a stream's requests, reads and writes go through, from the client's head to the backend's last chunk.
# Not spotdrain/http1.py: its answer's body is an async generator, which mypyc does not compile.
COMPILED = [
    "gateway/backends.py",
    "gateway/chunk_shape.py",
    "gateway/continuation.py",
    "gateway/ends.py",
    "gateway/proxy.py",
    "gateway/relay.py",
    "gateway/request.py",
    "gateway/server.py",
    "gateway/splice.py",
    "gateway/sse.py",
    "gateway/streaming.py",
    "gateway/token_ids.py",
    "spotdrain/framing.py",
    "spotdrain/http1_delivery.py",
    "spotdrain/http1_reads.py",
]
COMPILE_ENV = "SPOTDRAIN_COMPILE"


def extensions() -> list[object]:
    if os.environ.get(COMPILE_ENV) != "1":
        return []
    from mypyc.build import mypycify  # only where asked for: mypy is then installed

    return list(mypycify(COMPILED, opt_level="3"))


setup(ext_modules=extensions())
