"""Shared helpers for the bench sections: bounded subprocesses, medians and row building.

Every child runs in its own session so that a timeout kills its whole process group
(a launcher and the workers it started) by process-group id, never by name.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

TIMEOUT_S = 120.0

Row = dict[str, Any]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child: ours, one OpenMP thread, no inherited launcher variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELKIT_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


class ChildTimes(NamedTuple):
    wall: float  # seconds from start to exit
    cpu: float  # user + system seconds of the child and of the descendants it waited for
    stdout: str


def run_child(
    cmd: Sequence[str], env: dict[str, str], cwd: str | None = None, timeout: float = TIMEOUT_S
) -> tuple[float, str]:
    """Run ``cmd`` to completion; return (wall seconds, stdout). Raise on failure or timeout."""
    times = run_child_timed(cmd, env, cwd, timeout)
    return times.wall, times.stdout


def run_child_timed(
    cmd: Sequence[str], env: dict[str, str], cwd: str | None = None, timeout: float = TIMEOUT_S
) -> ChildTimes:
    """:func:`run_child`, plus the CPU time of the child's process tree (valid as children run one at a time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise RuntimeError(f"{' '.join(cmd)} did not finish within {timeout:g} s; killed") from None
    except BaseException:
        _kill_group(proc)
        raise
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    _kill_group(proc)  # stragglers the child left behind in its session, if any
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{err[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return ChildTimes(wall, cpu, out)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the child's process group (its session) and reap the child if still running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.returncode is None:
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def paired_row(
    name: str, ours: Sequence[float], ref: Sequence[float], target: float | None = None, unit: str = "s"
) -> Row:
    """A row comparing paired samples: medians of each, median paired difference and ratio."""
    if len(ours) != len(ref) or not ours:
        raise ValueError(f"{name}: need equal, non-empty paired samples, got {len(ours)} and {len(ref)}")
    diff = statistics.median(a - b for a, b in zip(ours, ref, strict=True))
    return {
        "name": name,
        "unit": unit,
        "accelkit": statistics.median(ours),
        "reference": statistics.median(ref),
        "diff": diff,
        "ratio": statistics.median(a / b for a, b in zip(ours, ref, strict=True)),
        "target": target,
        "ok": None if target is None else diff <= target,
        "n": len(ours),
    }
