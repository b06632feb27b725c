"""Workers that die with the process that started them.

A launcher killed with SIGKILL (out of memory, ``kill -9``, a scheduler) runs no cleanup: its
workers would live on as orphans, holding ports and GPU memory, or blocking forever in a
collective. On Linux a worker asks the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), and checks that its parent is still the process that started it
(the parent may have died before the request). Torch-free, so that every worker asks first thing,
before it imports torch or the script: ``accelkit launch``'s (``accelkit._cli._worker``), spawned
function workers (:mod:`._function_worker`) and forked ones alike.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["LoaderWorkerLifeline", "die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int | None, signum: int = signal.SIGKILL) -> bool:
    """Receive ``signum`` when this process's parent dies; exit now if ``parent`` is already gone.

    ``parent`` is the pid of the process that started this one (None: whichever parent it has now).
    Returns whether the kernel took the request (Linux); elsewhere nothing is arranged.

    Example:
        >>> die_with_parent(os.getppid(), signal.SIGTERM)  # doctest: +SKIP
        True
    """
    arranged = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            arranged = libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
        except (OSError, AttributeError):  # no libc to ask (a static or unusual build)
            arranged = False
    if parent is not None and os.getppid() != parent:
        os._exit(128 + int(signum))  # the parent died before the request: go as if it had arrived
    return arranged


class LoaderWorkerLifeline:
    """A DataLoader ``worker_init_fn`` that makes the worker die with its rank, then calls ``inner``.

    DataLoader workers notice a dead parent only every few seconds; with this they go at once.
    Picklable (DataLoader workers may be spawned).
    """

    def __init__(self, inner: object = None) -> None:
        self.inner = inner

    def __call__(self, worker_id: int) -> None:
        die_with_parent(None)
        if callable(self.inner):
            self.inner(worker_id)
