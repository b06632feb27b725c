"""The running experiment trackers of this process: started by ``ak.init_trackers``, ended once.

Their record is held by the process-global object (``_state.this_process.tracking``), which ends
them when the state is reset (``ak.reset_state()``, ``ak.end_training()``); interpreter exit and a
failing worker end them too, marked failed where the run failed.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any

from .._state import this_process

__all__ = ["TrackingState", "current_tracking", "end_trackers", "start_tracking"]


class TrackingState:
    """The experiment trackers of this process (``ak.init_trackers``); ended with the process state.

    - ``started``: ``ak.init_trackers`` was called (on any rank); ``is_main``: this process writes.
    - ``trackers``: name -> running tracker, on the main process only. Each has ``log(values, step)``,
      ``finish(failed)`` and ``writer``; :meth:`end` finishes them.
    - ``directory``: the run's folder (``project_dir/project_name``); ``step``: the last step logged.
    - ``pid``: the process that started them; a forked child never writes to its parent's files.
    """

    __slots__ = ("directory", "is_main", "pid", "started", "step", "trackers")

    def __init__(
        self, started: bool = False, is_main: bool = False, trackers: dict[str, Any] | None = None, directory: str = ""
    ) -> None:
        self.started = started
        self.is_main = is_main
        self.trackers: dict[str, Any] = {} if trackers is None else trackers
        self.directory = directory
        self.step = -1
        self.pid = os.getpid()

    def end(self, failed: bool) -> list[tuple[str, BaseException]]:
        """Flush and close every tracker, each even when another fails; what failed, by name.

        ``failed`` tells the trackers that keep a run status (W&B, MLflow) that the job failed.
        """
        errors: list[tuple[str, BaseException]] = []
        for name, tracker in self.trackers.items():
            try:
                tracker.finish(failed)
            except Exception as exc:  # one tracker's failure must not keep the others' data from the disk
                errors.append((name, exc))
        return errors


def start_tracking(is_main: bool, trackers: dict[str, Any], directory: str) -> TrackingState:
    """Record the trackers ``ak.init_trackers`` started (after ending any still running)."""
    with this_process.lock:
        end_trackers(failed=False)
        tracking = TrackingState(started=True, is_main=is_main, trackers=dict(trackers), directory=directory)
        this_process.swap_tracking(tracking)
        if trackers:  # they write from buffers and threads of their own: end them before the interpreter goes
            this_process.once("end trackers at exit", lambda: atexit.register(_end_trackers_at_exit))
        return tracking


def current_tracking() -> TrackingState:
    """This process's trackers (a forked child has none: its parent's files are not its own)."""
    tracking = this_process.tracking
    if tracking is None or tracking.pid != os.getpid():
        return TrackingState()
    return tracking  # type: ignore[no-any-return]


end_trackers = this_process.end_tracking  # flush, close and forget the running trackers


def _end_trackers_at_exit() -> None:
    # Python keeps an uncaught exception in sys.last_value before the atexit hooks run.
    errors = end_trackers(failed=getattr(sys, "last_value", None) is not None)
    for name, exc in errors:
        print(f"accelkit: could not close the {name} tracker at exit: {exc!r}", file=sys.stderr)
