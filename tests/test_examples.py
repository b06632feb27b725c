"""The examples the README tells users to run still work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.distributed
def test_pi_example_runs_on_two_processes() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELKIT_", "PYTEST_"))}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "pi.py"), "--darts", "200000"],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "rank 0:" in done.stderr and "rank 1:" in done.stderr
    assert done.stderr.index("rank 0:") < done.stderr.index("rank 1:")
    estimate = float(done.stdout.strip().rsplit(" ", 1)[-1])
    assert abs(estimate - 3.1416) < 0.05
