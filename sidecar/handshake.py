"""The drain handshake with the engine container, through files in an emptyDir both containers mount.

The engine's preStop is ``exec: [/bin/sh, <dir>/prestop]``. The script creates ``<dir>/drain`` and waits for
``<dir>/drained``, which the sidecar writes once no stream is left, so the engine gets its SIGTERM only then.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

PRESTOP_TEMPLATE = """\
#!/bin/sh
# preStop hook of the engine container, written by the spotdrain sidecar.
# Asks the sidecar to drain this pod and returns once every stream has finished,
# or after {limit_s} s if the sidecar never answers (the pod's grace period ends it sooner).
dir='{directory}'
: > "$dir/drain"
waited=0
while [ ! -e "$dir/drained" ] && [ "$waited" -lt {ticks} ]; do
  sleep 0.2 2>/dev/null || sleep 1
  waited=$((waited + 1))
done
exit 0
"""


@dataclass(frozen=True)
class DrainDir:
    path: Path

    @property
    def prestop(self) -> Path:
        return self.path / "prestop"

    @property
    def drain(self) -> Path:
        return self.path / "drain"

    @property
    def drained(self) -> Path:
        return self.path / "drained"

    def prepare(self, *, limit_s: float) -> bool:
        """Write the preStop script (atomically) and clear a stale ``drained``; True if a drain is already asked.

        The directory outlives a restart of the sidecar container, so a ``drain`` left by a preStop that is
        still waiting must be honoured, while a ``drained`` from before would release the engine too early.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        self.drained.unlink(missing_ok=True)
        # Counted in 0.2 s ticks; with integer-only sleep each tick lasts 1 s and the wait is longer, never shorter.
        script = PRESTOP_TEMPLATE.format(
            directory=str(self.path).replace("'", "'\\''"),
            limit_s=math.ceil(limit_s),
            ticks=math.ceil(limit_s * 5),
        )
        partial = self.path / ".prestop.partial"
        partial.write_text(script)
        partial.chmod(0o755)
        os.replace(partial, self.prestop)
        return self.drain.exists()

    def drain_requested(self) -> bool:
        return self.drain.exists()

    def mark_drained(self) -> None:
        self.drained.touch()
