"""Workers that die with the process that started them.

A launcher killed with SIGKILL (out of memory, ``kill -9``, a scheduler) runs no cleanup: its
workers would live on as orphans, holding ports and GPU memory, or blocking forever in a
collective. On Linux a worker asks the kernel for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``), and checks that its parent is still the process that started it
(the parent may have died before the request). Torch-free: ``accelkit launch``'s workers call it first.

A spawned worker can ask only once it runs accelkit's code: after ``import torch`` and the
script's other imports, seconds on a busy machine (10 and more with 4 workers on 2 cores). A
launcher killed in that window used to leave them running until then. So while workers start,
a small watcher (:func:`reaper`) waits on a pipe from the launcher: when the pipe closes without
the launcher's "done", it kills every process whose environment names this launch's run
directory (its workers, and their DataLoader workers).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["LoaderWorkerLifeline", "die_with_parent", "reaper"]

# The watcher's program (python -I -S -c ...; argv[1]: the environment entry that marks the workers).
_REAPER = r"""
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)  # a Ctrl-C for the launcher is not for this one: it waits for the pipe
if sys.stdin.buffer.read() == b"done":
    sys.exit(0)
mark, me, killed = sys.argv[1].encode(), os.getpid(), set()
while True:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me and int(name) not in killed:
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(name))
            except OSError:
                pass
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        killed.add(pid)
"""


@contextlib.contextmanager
def reaper(mark: str) -> Iterator[None]:
    """Kill the processes whose environment holds ``mark`` (``NAME=value``) should this process die in the block.

    Linux only (elsewhere nothing is arranged). The watcher runs in a session of its own, so that
    a terminal's Ctrl-C reaches only the launcher, which then stops the workers itself.
    """
    if not sys.platform.startswith("linux"):
        yield
        return
    watcher = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _REAPER, mark],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield
    finally:
        try:
            if watcher.stdin is not None:
                watcher.stdin.write(b"done")
                watcher.stdin.close()
        except OSError:  # it died (killed with its session): nothing to tell it
            pass
        watcher.wait()


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
