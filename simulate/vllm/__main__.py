"""``python -m simulate.vllm install``: put real vLLM and the tiny model in place, or say why they cannot be."""

from __future__ import annotations

import sys

from simulate.venvs import install_command
from simulate.vllm.server import install, tiny_model, venv_dir

if __name__ == "__main__":
    sys.exit(install_command(sys.argv[1:], "vLLM", install, lambda: f"{venv_dir()} serving {tiny_model()}"))
