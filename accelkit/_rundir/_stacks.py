"""Where a worker that died from a fatal signal was: ``faulthandler``'s stacks, kept in the run directory.

The worker side imports nothing beyond ``os`` and ``faulthandler``: it is armed in every worker
before the user's code runs (``accelkit launch`` scripts too).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["crash_stacks", "record_crashes"]

_CRASHES = "crashes"
_CRASH_LINES = 80  # of the Python stacks a fatal signal left: the crashing thread's come first
_crash_file: Any = None  # open for as long as the process lives: faulthandler writes to its descriptor


def record_crashes(run_dir: str) -> None:
    """Where this worker dies from a fatal signal (SIGSEGV, SIGBUS, SIGFPE, SIGABRT, SIGILL), its
    Python stacks go to the run directory, where the launcher finds them (:func:`crash_stacks`).

    A process that has ``faulthandler`` on already (``PYTHONFAULTHANDLER``, ``-X faulthandler``) keeps it
    as it is.
    """
    global _crash_file
    import faulthandler

    if faulthandler.is_enabled():
        return
    folder = os.path.join(run_dir, _CRASHES)
    os.makedirs(folder, exist_ok=True)
    _crash_file = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")
    faulthandler.enable(_crash_file, all_threads=True)


def crash_stacks(run_dir: str, pid: int | None) -> str:
    """What :func:`record_crashes` caught in process ``pid``, the crashing thread first; "" if nothing."""
    try:
        with open(os.path.join(run_dir, _CRASHES, f"{pid}.txt")) as f:
            text = f.read()
    except OSError:
        return ""
    blocks = [b for b in text.strip().split("\n\n") if not b.startswith("Extension modules:")]
    blocks.sort(key=lambda b: not b.startswith(("Fatal Python error", "Current thread")))  # stable: the error first
    return "\n".join("\n\n".join(blocks).splitlines()[:_CRASH_LINES])
