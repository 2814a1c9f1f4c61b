"""The ways of handling a Spot notice that ``spotdrain simulate --compare`` plays on the same node, pods and load.

``spotdrain`` is this project as ``deploy/`` ships it. The others are re-enactments of what users run without it,
written here from the other projects' documentation and defaults: none of them is another project's code.

- ``nth-style``: aws-node-termination-handler's default behaviour (``simulate.nth``): cordon, then evict every pod at
  once with its own grace period. The pods keep vLLM's usual readiness probe (``httpGet /health``) and no preStop, so
  nothing takes a pod out of rotation before its eviction, and the engine gets SIGTERM at once. vLLM aborts its
  in-flight requests on SIGTERM unless ``--shutdown-timeout`` is set (vllm-project/vllm#36666: "immediate termination
  by default (--shutdown-timeout=0)"), as the fake engine does.
- ``seed-prestop``: the same handler, and the engine container carries the preStop hook and readiness probe the
  Spot-serving write-ups recommend (``SEED_PRESTOP``), as published: its loop is written ``WHILE``.
- ``seed-prestop-fixed``: the same hook with that typo corrected.
- ``none``: nothing handles the notice; the instance goes at the deadline with whatever is on it.
"""

from __future__ import annotations

import enum
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path


class Readiness(enum.Enum):
    SIDECAR = "sidecar"  # the sidecar container's own probe of its /ready, as spotdrain's injection adds it
    HEALTH = "health"  # httpGet /health on the engine, as vLLM's Kubernetes guide has it
    SEED = "seed"  # the write-ups' exec probe: SEED_READINESS


# A re-enactment of the write-ups' hook, not their code: ``touch /tmp/draining`` (the readiness probe below then
# fails), ``sleep 15`` for the load balancer to notice, then poll the engine's running-requests gauge every 2 s, up to
# 90 s (45 rounds), until it reads zero. As published, the loop is written ``WHILE``. The hook is one line, as an exec
# ``[/bin/sh, -c, ...]`` carries it, so ``sh`` parses it whole before running any of it: ``WHILE`` is taken for a
# command and the ``do`` after it is a syntax error (exit 2 in dash, bash and busybox ash). Nothing runs, not even
# the ``touch``: the hook fails at once, and the kubelet goes on to SIGTERM as if there were no hook.
SEED_PRESTOP = (
    "touch /tmp/draining; sleep 15; i=0; WHILE [ $i -lt 45 ]; do "
    "running=$(curl -s localhost:8000/metrics | grep vllm:num_requests_running | grep -v '^#' | awk '{print $2}'); "
    '[ "$running" = "0.0" ] && break; sleep 2; i=$((i + 1)); done'
)
SEED_PRESTOP_FIXED = SEED_PRESTOP.replace("WHILE", "while")
SEED_READINESS = "test ! -f /tmp/draining"
SEED_NEEDS = ("curl", "grep", "awk")  # what the fixed hook runs; a machine without one of them skips that way


@dataclass(frozen=True)
class Way:
    name: str
    title: str  # what it is, as the table's legend says it
    spotdrain: bool  # spotdrain's node agent and the pods' sidecars run
    evicts: bool  # the nth-style handler cordons the node and evicts its pods on the notice
    readiness: Readiness
    prestop: str | None = None  # the engine container's preStop, as ``sh -c`` text, before ``adapted``
    needs: tuple[str, ...] = ()


SPOTDRAIN = Way(
    "spotdrain", "spotdrain: node agent and sidecars, as deploy/ ships them", True, False, Readiness.SIDECAR
)
WAYS: tuple[Way, ...] = (
    SPOTDRAIN,
    Way(
        "nth-style",
        "re-enactment of aws-node-termination-handler's defaults: cordon, evict every pod with its own grace period; "
        "no readiness flip, no preStop, the engine aborts its streams on SIGTERM",
        False,
        True,
        Readiness.HEALTH,
    ),
    Way(
        "seed-prestop",
        "re-enactment of the write-ups' preStop hook (touch, sleep 15, poll the engine up to 90 s) as published, its "
        "loop written WHILE: sh rejects it, the hook fails at once; evictions as nth-style",
        False,
        True,
        Readiness.SEED,
        prestop=SEED_PRESTOP,
    ),
    Way(
        "seed-prestop-fixed",
        "the same hook with WHILE corrected to while; evictions as nth-style",
        False,
        True,
        Readiness.SEED,
        prestop=SEED_PRESTOP_FIXED,
        needs=SEED_NEEDS,
    ),
    Way("none", "nothing handles the notice: the instance goes at the deadline", False, False, Readiness.HEALTH),
)
BY_NAME = {way.name: way for way in WAYS}


def missing(way: Way) -> str | None:
    """Why ``way`` cannot run on this machine (a command its hook needs is not installed), or None."""
    absent = [command for command in way.needs if shutil.which(command) is None]
    if not absent:
        return None
    return f"{', '.join(absent)} not installed on this machine: the hook could not poll the engine"


def adapted(script: str, *, tmp: Path, engine_port: int, scale: float) -> str:
    """The write-ups' text as it runs here, changed only where one machine with many pods and compressed time
    demand it: the pod's own directory stands for its container's ``/tmp``, the engine's port for 8000, and the
    sleeps are scaled as the notice is (``scale``: the simulation's seconds per real second), so the hook holds
    for 15 s and polls for up to 90 s of a 120 s notice."""
    return (
        script.replace("/tmp/draining", shlex.quote(str(tmp / "draining")))
        .replace("localhost:8000", f"localhost:{engine_port}")
        .replace("sleep 15;", f"sleep {round(15 * scale, 3):g};")
        .replace("sleep 2;", f"sleep {round(2 * scale, 3):g};")
    )


def shell(text: str) -> tuple[str, ...]:
    """An exec hook or probe of one ``sh -c`` line, as the pod spec writes it."""
    return ("/bin/sh", "-c", text)
