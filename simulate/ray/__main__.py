"""``python -m simulate.ray install``: put real Ray Serve in place, or say why it cannot be.

Exits 0 either way: a machine without Ray runs the Ray tests of the real-engine tier as skipped, with this reason.
"""

from __future__ import annotations

import sys

from simulate.ray.server import install, venv_dir


def main(argv: list[str]) -> int:
    if argv != ["install"]:
        print("usage: python -m simulate.ray install", file=sys.stderr)
        return 2
    reason = install()
    if reason is not None:
        print(f"real Ray skipped: {reason}")
        return 0
    print(f"real Ray ready: {venv_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
