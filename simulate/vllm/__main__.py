"""``python -m simulate.vllm install``: put real vLLM and the tiny models in place, or say why they cannot be."""

from __future__ import annotations

import sys

from simulate.venvs import install_command
from simulate.vllm.server import install, thinking_model, tiny_model, venv_dir


def _ready() -> str:
    return f"{venv_dir()} serving {tiny_model()} and {thinking_model()}"


if __name__ == "__main__":
    sys.exit(install_command(sys.argv[1:], "vLLM", install, _ready))
