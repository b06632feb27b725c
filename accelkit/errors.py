"""The exceptions accelkit raises. Each subclasses the builtin it refines."""

import re
from typing import NamedTuple

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "DistributedOperationError",
    "NoExecutableBatchSizeError",
    "StateError",
    "WorkerError",
    "WorkerFailure",
]


class ConfigurationError(ValueError):
    """An option, environment variable or config value is invalid."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or the one on disk is damaged or does not fit."""


class StateError(RuntimeError):
    """The process state was asked for something it cannot do (e.g. conflicting ``init``)."""


class DistributedOperationError(RuntimeError):
    """A collective could not be applied because the ranks disagree about it."""


class NoExecutableBatchSizeError(RuntimeError):
    """``find_executable_batch_size`` ran out of memory with every batch size down to 1 (or started at 0)."""


class WorkerFailure(NamedTuple):
    """What one failed worker reported.

    ``exc_type`` and ``message`` are empty when the process died without a Python
    exception (a signal, ``os._exit``); ``exitcode`` then says how it ended.
    """

    rank: int
    local_rank: int
    pid: int | None
    exitcode: int | None
    exc_type: str
    message: str
    traceback: str
    timestamp: float
    lost_peer: bool = False  # it failed because another rank went away or never came (never the root cause)

    def headline(self) -> str:
        if self.exc_type:
            return f"{self.exc_type}: {self.message}" if self.message else self.exc_type
        return _describe_exit(self.exitcode)


class WorkerError(RuntimeError):
    """One or more workers of a multi-process run failed.

    ``failures`` lists them root cause first (the earliest failure leads; a worker that
    died from SIGTERM without an error of its own was stopped, so it comes last). The other
    workers were stopped before this was raised. ``cause``, when known, leads the message: what
    made them fail from outside (a node of the job that was lost).
    """

    def __init__(self, failures: list[WorkerFailure], what: str = "workers", cause: str = "") -> None:
        self.failures = sorted(failures, key=_root_cause_order)
        self.cause = cause
        super().__init__(self._format(what))

    @property
    def ranks(self) -> list[int]:
        """The failed ranks, root cause first."""
        return [f.rank for f in self.failures]

    def _format(self, what: str) -> str:
        if not self.failures:
            return f"the {what} failed without reporting an error"
        first = self.failures[0]
        lines = [
            _waited_for(first)
            or (
                f"rank {first.rank} failed: {first.headline()}"
                + (f" (and {len(self.failures) - 1} more)" if len(self.failures) > 1 else "")
            ),
            "Failures, root cause first:",
        ]
        for f in self.failures:
            where = f"local rank {f.local_rank}" + (f", pid {f.pid}" if f.pid else "")
            if f.exitcode not in (None, 0, 1) or not f.exc_type:
                where += f", {_describe_exit(f.exitcode)}"
            lines.append(f"  - rank {f.rank} ({where}): {f.headline()}")
            if f.traceback:
                lines.extend("      " + line for line in f.traceback.rstrip().splitlines())
        return "\n".join([self.cause, *lines] if self.cause else lines)


_SIGTERM = 15  # what the agent sends the workers it stops after a failure

# How a collective that gave up says whom it waited for (accelkit._collectives, accelkit._group's board).
# Patterns, not compiled ones: compiled (and cached by ``re``) only when a failure is described.
_GAVE_UP = r"^(accelkit\.\w+ #\d+) failed on process \d+ of \d+: "
_WHERE = r"^  - process (\d+): (.+)$"


def _waited_for(first: WorkerFailure) -> str:
    """When the root failure is a rank that gave up waiting, a headline that names the rank it waited for.

    That rank is the cause (it hangs, or is stuck elsewhere): it leads, with where it is; the
    waiting rank's own error (the backend's timeout text) follows in the list. "" otherwise.
    """
    call = re.match(_GAVE_UP, first.message)
    missing = re.search(r"^process(?:es)? ([\d, ]+) never reached it$", first.message, re.MULTILINE)
    if not (first.lost_peer and call and missing):
        return ""
    where = dict(re.findall(_WHERE, first.message, re.MULTILINE))
    ranks = [r.strip() for r in missing.group(1).split(",")]
    if len(ranks) == 1:
        who, places = f"rank {ranks[0]}", f"it is {where.get(ranks[0], 'gone (no position known)')}"
    else:
        who = f"ranks {', '.join(ranks)}"
        places = "; ".join(f"rank {r} is {where.get(r, 'gone (no position known)')}" for r in ranks)
    return f"{who} never reached {call.group(1)}: {places}; rank {first.rank} gave up waiting"


def _root_cause_order(f: WorkerFailure) -> tuple[bool, bool, float, int]:
    # A worker that died from SIGTERM without an error of its own was stopped because another
    # failed: never the root cause while another failure is known. (The agent also stamps deaths
    # to the whole second, which would put it before the exception that caused it.) A worker whose
    # collective lost its peer or timed out waiting for it failed because of another: after every
    # failure of its own kind (an exception, a death by signal), whatever the timestamps say.
    stopped = not f.exc_type and f.exitcode == -_SIGTERM
    return (stopped, f.lost_peer, f.timestamp, f.rank)


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not finish"
    if exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = " (killed; out of memory?)" if name == "SIGKILL" else ""
        return f"died from {name}{hint}"
    return f"exited with code {exitcode} without a Python exception"
