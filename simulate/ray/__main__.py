"""``python -m simulate.ray install``: put real Ray Serve in place, or say why it cannot be."""

from __future__ import annotations

import sys

from simulate.ray.server import install, venv_dir
from simulate.venvs import install_command

if __name__ == "__main__":
    sys.exit(install_command(sys.argv[1:], "Ray", install, lambda: str(venv_dir())))
