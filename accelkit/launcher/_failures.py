"""Each worker's own failure report, and the :class:`~accelkit.WorkerError` made from them.

A worker records its exception (type, message, traceback without accelkit's frames, time)
in the run's directory before it dies, so the launcher names every failed rank, root cause
first, whatever the elastic agent (or mpirun) noticed first.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .. import _env, _frames, _safe_io
from ..errors import ConfigurationError, WorkerError, WorkerFailure

__all__ = ["collect_failures", "exception_name", "lost_peer", "record_failure", "report_stop"]


def record_failure(run_dir: str, exc: BaseException, text: str | None = None) -> None:
    """Write this worker's failure report atomically into the run directory."""
    try:
        where = _env.detect_launch()  # torchrun's variables, or mpirun's
    except ConfigurationError:
        where = _env.LaunchEnv("none")
    # Before the agent's variables are set (a spawned worker still importing the main module) the rank
    # is unknown: the report is then matched to its rank by pid.
    rank = where.rank if where.launcher != "none" else None
    folder = os.path.join(run_dir, "failures", f"attempt{where.restart_count}")
    os.makedirs(folder, exist_ok=True)
    report = {
        "rank": rank,
        "local_rank": where.local_rank,
        "pid": os.getpid(),
        "exc_type": exception_name(exc),
        "message": str(exc),
        "traceback": text if text is not None else _frames.user_traceback(exc),
        "timestamp": time.time(),
        "lost_peer": lost_peer(exc),
    }
    name = f"rank{rank}.json" if rank is not None else f"pid{os.getpid()}.json"
    _safe_io.write_atomic(Path(folder) / name, json.dumps(report).encode())


# How a collective fails because of another rank: it went away, or never came.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "stopped the group first")  # fmt: skip


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it came from) says that a peer rank went away or never came.

    Example:
        >>> lost_peer(RuntimeError("Read error: Connection reset by peer"))
        True
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(marker in str(e) for marker in _LOST_PEER):
            return True
        e = e.__cause__ or e.__context__
    return False


def exception_name(exc: BaseException) -> str:
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def collect_failures(run_dir: str, agent_failures: dict[int, Any], cause: str = "") -> WorkerError:
    """Merge the workers' own reports with what the agent saw (exit codes, signals); ``cause`` leads."""
    reports: dict[int, dict[str, Any]] = {}
    by_pid: dict[int, dict[str, Any]] = {}
    root = os.path.join(run_dir, "failures")
    attempts = sorted(os.listdir(root), key=lambda a: int(a[7:])) if os.path.isdir(root) else []
    if attempts:
        last = os.path.join(root, attempts[-1])
        for name in os.listdir(last):
            if name.endswith(".json"):
                with open(os.path.join(last, name)) as f:
                    report = json.load(f)
                if report["rank"] is None:
                    by_pid[report["pid"]] = report
                else:
                    reports[report["rank"]] = report
    for rank, seen in agent_failures.items():
        if rank not in reports and getattr(seen, "pid", None) in by_pid:
            reports[rank] = {**by_pid[seen.pid], "rank": rank}
    failures = []
    for rank in sorted(set(reports) | set(agent_failures)):
        seen = agent_failures.get(rank)
        report = reports.get(rank, {})
        failures.append(
            WorkerFailure(
                rank=rank,
                local_rank=report.get("local_rank", getattr(seen, "local_rank", 0)),
                pid=report.get("pid", getattr(seen, "pid", None)),
                exitcode=getattr(seen, "exitcode", None) if seen is not None else 1,
                exc_type=report.get("exc_type", ""),
                message=report.get("message", ""),
                traceback=report.get("traceback", ""),
                timestamp=report.get("timestamp", getattr(seen, "timestamp", time.time())),
                lost_peer=bool(report.get("lost_peer", False)),
            )
        )
    return WorkerError(failures, cause=cause)


def report_stop(exc: BaseException) -> int:
    """Say that the job was stopped (Ctrl-C, or the agent's SignalException); the exit code a shell would give.

    130 for SIGINT, 143 for SIGTERM: 128 + the signal, as for a process ended by it.
    """
    signum = int(getattr(exc, "sigval", signal.SIGINT))
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"accelkit: {what}; every worker was stopped", file=sys.stderr)
    return 128 + signum
