"""``python -m simulate.vllm install``: put real vLLM and the tiny model in place, or say why they cannot be.

Exits 0 either way: a machine without vLLM runs the real-engine tier as skipped, with this reason.
"""

from __future__ import annotations

import sys

from simulate.vllm.server import install, tiny_model, venv_dir


def main(argv: list[str]) -> int:
    if argv != ["install"]:
        print("usage: python -m simulate.vllm install", file=sys.stderr)
        return 2
    reason = install()
    if reason is not None:
        print(f"real vLLM skipped: {reason}")
        return 0
    try:
        model = tiny_model()
    except (OSError, RuntimeError) as error:
        print(f"real vLLM skipped: {error}")
        return 0
    print(f"real vLLM ready: {venv_dir()} serving {model}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
