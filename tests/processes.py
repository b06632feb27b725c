"""What the processes a test starts share: a clean environment and a way to tell they are gone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
# Twenty runs that must all exit cleanly, as ten tests of two: each stays well within a per-test
# timeout on a loaded machine (five launches took 109 s on 2 cores at a load of 10-14, each starting
# three interpreters that import torch), and parallel test runners spread them.
RUNS_OF_TWENTY = [pytest.param(range(i, i + 2), id=f"runs {i + 1}-{i + 2}") for i in range(0, 20, 2)]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a process a test starts: CPU ranks with one thread each, on every machine.

    The test session's ``ACCELKIT_*`` and ``PYTEST_*`` variables are left out, no config file is read,
    and accelkit is imported from this checkout; ``extra`` is set last.

    >>> subprocess_env(OMP_NUM_THREADS="2")["OMP_NUM_THREADS"]
    '2'
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELKIT_", "PYTEST_"))}
    env.update(ACCELKIT_CONFIG_FILE="", ACCELKIT_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False
