"""``spotdrain simulate --engine vllm``: the whole interruption with real vLLM processes serving the pods."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.usefixtures("vllm_model")
def test_a_simulated_interruption_on_real_vllm_keeps_every_stream(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "spotdrain.cli", "simulate", "--engine", "vllm", "--pods", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    result = json.loads(done.stdout) if done.stdout.strip().startswith("{") else None
    failed = [c for c in result["checks"] if not c["passed"]] if result else done.stderr[-2000:]
    assert done.returncode == 0, failed
    assert result is not None
    assert result["passed"], failed
    summary = result["summary"]
    assert summary["started"] >= 2
    assert summary["completed"] == summary["started"]
    assert summary["cut"] == 0
