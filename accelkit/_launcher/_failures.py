"""The :class:`~accelkit.WorkerError` made from the workers' own failure records (``accelkit._rundir``) and
what the agent saw, root cause first; what is said when the agent restarts the workers, or is stopped."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from .._group import Position
from .._rundir import Spot, read_failures, stacks_of, where_each_was, where_it_was
from ..errors import WorkerError, WorkerFailure

__all__ = ["RestartNotice", "collect_failures", "report_stop"]

_SIGTERM = int(signal.SIGTERM)  # how the agent stops the other workers after one failed


def collect_failures(
    run_dir: str, agent_failures: dict[int, Any], cause: str = "", positions: dict[int, Position] | None = None
) -> WorkerError:
    """Merge the workers' own reports with what the agent saw (exit codes, signals); ``cause`` leads, else what
    the ranks' stacks, records and last ``positions`` show of a collective some of them reached alone."""
    reports: dict[int, dict[str, Any]] = {}
    by_pid: dict[int, dict[str, Any]] = {}
    for report in read_failures(run_dir)[1]:
        if report["rank"] is None:
            by_pid[report["pid"]] = report
        else:
            reports[report["rank"]] = report
    for rank, seen in agent_failures.items():
        if rank not in reports and getattr(seen, "pid", None) in by_pid:
            reports[rank] = {**by_pid[seen.pid], "rank": rank}
    failures = []
    spots = where_each_was(run_dir)  # every rank that left stacks; a rank's own record, below, comes first
    for rank in sorted(set(reports) | set(agent_failures)):
        seen = agent_failures.get(rank)
        report = reports.get(rank, {})
        exitcode = getattr(seen, "exitcode", None) or 0
        if not report and exitcode < 0:  # a death by signal: where it was (stopped: its main thread's line)
            report = {"traceback": stacks_of(run_dir, getattr(seen, "pid", None), main_only=exitcode == -_SIGTERM)}
            spot = where_it_was(run_dir, getattr(seen, "pid", None))
        else:
            spot = Spot(*report["spot"]) if report.get("spot") else None
        if spot is not None:
            spots[rank] = spot
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
    error = WorkerError(failures, cause=cause)
    if not cause and (spots or positions):
        from ._explain import explain

        cause = explain(error.failures, spots, positions or {})
        if cause:
            error = WorkerError(failures, cause=cause)
    return error


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
        self._read: set[str] = set()  # the attempts whose records were read

    def __call__(self, restart: int) -> None:
        if restart <= self._said:  # the first start, or a node joined (a restart that is no failure's)
            return
        self._said = restart
        attempt = read_failures(self.run_dir)[0]
        fresh = bool(attempt) and attempt not in self._read
        self._read.add(attempt)
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
