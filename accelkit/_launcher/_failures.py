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
from ._crashes import crash_stacks

__all__ = ["RestartNotice", "collect_failures", "exception_name", "lost_peer", "record_failure", "report_stop"]


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
# Any error of gloo's transport is about a pair of ranks (a peer gone, closed or silent): the first one a
# rank sees says "Connection reset by peer", a later one may say "Socket closed" or nothing of the kind.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
              "stopped the group first", "gloo/transport/", "Socket closed")  # fmt: skip


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
        if not report and (getattr(seen, "exitcode", None) or 0) < 0:  # a death by signal: where it was
            report = {"traceback": crash_stacks(run_dir, getattr(seen, "pid", None))}
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


class RestartNotice:
    """Says why the agent restarts the workers: the failed rank, its exception, "restarting (k of N)".

    Called as each attempt's workers start; from the second on, the failure that ended the attempt
    before is read from the workers' records. Where the workers printed no traceback (``@ak.distributed``,
    ``ak.launch``), the first failure's traceback follows its line, so that it is not lost when a later
    attempt succeeds.
    """

    def __init__(self, run_dir: str, max_restarts: int, tracebacks_shown: bool) -> None:
        self.run_dir, self.max_restarts, self.tracebacks_shown = run_dir, max_restarts, tracebacks_shown
        self._said = 0  # the restarts already announced
        self._read: set[str] = set()  # the attempts' folders already read

    def __call__(self, restart: int) -> None:
        if restart <= self._said:  # the first start, or a node joined (a restart that is no failure's)
            return
        self._said = restart
        root = os.path.join(self.run_dir, "failures")
        folders = sorted(os.listdir(root), key=lambda a: int(a[7:])) if os.path.isdir(root) else []
        fresh = bool(folders) and folders[-1] not in self._read
        self._read.update(folders)
        failures = collect_failures(self.run_dir, {}).failures if fresh else []
        if failures:
            first = failures[0]
            what = f"rank {first.rank} failed: {first.headline()}"
        else:
            what = "a worker ended without a report of its own (killed by a signal?)"
        lines = [f"accelkit: {what}; restarting ({restart} of {self.max_restarts})"]
        if failures and restart == 1 and not self.tracebacks_shown and failures[0].traceback:
            lines += ["      " + line for line in failures[0].traceback.rstrip().splitlines()]
        print("\n".join(lines), file=sys.stderr, flush=True)


def report_stop(exc: BaseException) -> int:
    """Say that the job was stopped (Ctrl-C, or the agent's SignalException); the exit code a shell would give.

    130 for SIGINT, 143 for SIGTERM: 128 + the signal, as for a process ended by it.
    """
    signum = int(getattr(exc, "sigval", signal.SIGINT))
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    print(f"accelkit: {what}; every worker was stopped", file=sys.stderr)
    return 128 + signum
