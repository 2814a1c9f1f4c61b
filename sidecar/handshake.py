"""The drain handshake with the engine container, through files in an emptyDir both containers mount.

The engine's preStop is ``exec: [/bin/sh, <dir>/prestop]``. The script creates ``<dir>/drain``, writes a byte into
the FIFO ``<dir>/ask`` and waits for ``<dir>/drained``, which the sidecar writes once no stream is left, so the
engine gets its SIGTERM only then. The sidecar waits on a read of ``ask`` (no timer: an idle sidecar never looks),
and a sidecar that starts while a preStop already waits finds ``drain``. The script waits by blocking on a read of
the FIFO ``<dir>/hold``, which this process holds open until then: the engine image needs nothing but ``sh`` (dash,
busybox ash or bash, not even ``sleep``), and the script wakes at once when the sidecar closes the FIFO, whether
because it drained or because it died.
"""

from __future__ import annotations

import math
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

PRESTOP_TEMPLATE = """\
#!/bin/sh
# preStop hook of the engine container, written by the spotdrain sidecar: shell builtins only, no PATH needed.
# Asks the sidecar to drain this pod and returns once every stream has finished. The sidecar holds the FIFO
# "hold" open while it drains and closes it once "drained" exists, so the read below blocks without a timer and
# wakes at once, also when the sidecar dies. Where a sleep command exists, a timer ends the wait after {limit_s} s
# (a hung sidecar) and a sidecar that died is waited for until then; without one, a dead sidecar ends it at once.
dir='{directory}'
true > "$dir/drain"
# Wakes the sidecar, which waits on a read of "ask". Opened read-write, so the open never blocks (not even with no
# sidecar there) and the byte always fits; on a regular builtin, so a failed open ends nothing but the echo.
[ -p "$dir/ask" ] && echo 2> /dev/null 1<> "$dir/ask"
[ -e "$dir/drained" ] && exit 0
[ -p "$dir/hold" ] || exit 0
centis() {{ read -r up _ < /proc/uptime && echo $(( ${{up%.*}} * 100 + 1${{up#*.}} - 100 )); }}
start=$(centis) || start=
timer=
if [ -n "$start" ] && command -v sleep > /dev/null 2>&1; then
  # Wakes the read below by writing a line into the FIFO; opened read-write, so the open never blocks.
  ( trap 'kill "$s"; wait "$s"; exit 0' TERM; sleep {limit_s} & s=$!; wait "$s"; exec 5<>"$dir/hold"; echo >&5 ) \\
    < /dev/null > /dev/null 2>&1 &
  timer=$!
fi
# Open for writing first so that the open for reading cannot block; then the sidecar is the only writer.
exec 3<>"$dir/hold" 4<"$dir/hold" 3>&-
while [ ! -e "$dir/drained" ]; do
  if read -r _ <&4; then
    [ -n "$timer" ] && [ $(( $(centis) - start )) -ge {limit_cs} ] && break
  else
    # End of file: no writer is left. Unless it drained, the sidecar is gone: only with a timer is a new one waited for.
    [ -e "$dir/drained" ] || [ -z "$timer" ] && break
    exec 4<&- 4<"$dir/hold"
  fi
done
exec 4<&-
# Killed before its trap was set, the timer dies of the signal, which "wait" would report on stderr.
[ -n "$timer" ] && {{ kill "$timer"; wait "$timer"; }} 2> /dev/null
exit 0
"""


@dataclass
class DrainDir:
    path: Path
    _hold: int | None = field(default=None, repr=False, compare=False)
    _ask: int | None = field(default=None, repr=False, compare=False)

    @property
    def prestop(self) -> Path:
        return self.path / "prestop"

    @property
    def drain(self) -> Path:
        return self.path / "drain"

    @property
    def ask(self) -> Path:
        return self.path / "ask"

    @property
    def drained(self) -> Path:
        return self.path / "drained"

    @property
    def hold(self) -> Path:
        return self.path / "hold"

    @property
    def draining(self) -> Path:
        return self.path / "draining"

    def prepare(self, *, limit_s: float) -> bool:
        """Write the preStop script (atomically), hold the FIFOs it waits on and writes to, clear a stale
        ``drained``; True if a drain is already asked.

        The directory outlives a restart of the sidecar container, so a ``drain`` left by a preStop that is
        still waiting must be honoured, while a ``drained`` from before would release the engine too early.
        ``ask`` is open before ``drain`` is looked for: a preStop that starts in between is seen by one or the other.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        _remove(self.drained)
        # The engine may run as another user: it opens both read-write (the shell's `<>`, which never blocks on a FIFO).
        if self._hold is None:
            self._hold = _hold_fifo(self.hold, mode=0o666)
        if self._ask is None:
            self._ask = _hold_fifo(self.ask, mode=0o666)
        script = PRESTOP_TEMPLATE.format(
            directory=str(self.path).replace("'", "'\\''"),
            limit_s=math.ceil(limit_s),
            limit_cs=math.ceil(limit_s * 100),
        )
        partial = self.path / ".prestop.partial"
        partial.write_text(script)
        partial.chmod(0o755)
        os.replace(partial, self.prestop)
        return self.drain.exists()

    @property
    def asks(self) -> int:
        """The descriptor of ``ask``, readable once a preStop has written into it (after ``prepare``)."""
        if self._ask is None:
            raise RuntimeError("the drain directory is not prepared")
        return self._ask

    def take_asks(self) -> bool:
        """Read what the preStop wrote into ``ask``, without waiting; True if it wrote anything."""
        written = False
        while True:
            try:
                chunk = os.read(self.asks, 4096)
            except BlockingIOError:
                return written
            if not chunk:  # an end of file, which a FIFO this process holds open for writing never shows
                return written
            written = True

    def drain_requested(self) -> bool:
        return self.drain.exists()

    def mark_drained(self) -> None:
        """Write ``drained``, then let go of the FIFOs: a waiting preStop wakes and finds the file."""
        self.drained.touch()
        for descriptor in (self._hold, self._ask):
            if descriptor is not None:
                os.close(descriptor)
        self._hold = self._ask = None


def _hold_fifo(path: Path, *, mode: int) -> int:
    """Make the FIFO at ``path`` (kept from a previous run: a waiting preStop may have it open) and open it.

    Read-write, so the open does not wait for a peer (Linux) and a read never sees an end of file, and
    non-blocking, so nothing here ever waits.
    """
    if path.is_symlink() or (path.exists() and not stat.S_ISFIFO(path.stat().st_mode)):
        _remove(path)
    if not path.exists():
        os.mkfifo(path)
    os.chmod(path, mode)
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def _remove(path: Path) -> None:
    """Remove whatever is at ``path``, a directory included: the drain directory holds what others put there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
