"""The worker side of ``accelkit launch``: run a script or module as ``__main__``.

``python -m accelkit._cli._worker [--module] TARGET ARGS...`` runs TARGET the way ``python
TARGET ARGS...`` (or ``python -m TARGET ARGS...``) would: same ``sys.argv``, same
``sys.path[0]``. When it raises, the traceback is printed as Python would, and the
worker's failure record goes to the run directory named by ``ACCELKIT_RUN_DIR``, so that
the launcher names every failed rank, root cause first, with a traceback that starts in
the user's code. ``sys.exit(code)`` just exits with that code.
"""

from __future__ import annotations

import os
import runpy
import sys

from .. import _frames

# runpy's frames (frozen into the interpreter since Python 3.11) come before the user's, after this runner's.
_RUNPY = (os.path.abspath(runpy.__file__), "<frozen runpy>")


def main(argv: list[str]) -> int:
    """Run the target named by ``argv``; the process's exit code.

    Example:
        >>> main(["train.py", "--epochs", "3"])  # doctest: +SKIP
        0
    """
    _die_with_launcher()
    _record_stacks()
    module = bool(argv) and argv[0] in ("-m", "--module")
    if module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m accelkit._cli._worker [--module] TARGET [ARGS...]", file=sys.stderr)
        return 2
    target = argv[0]
    sys.argv = list(argv)
    try:
        if module:
            # `python -m` keeps the working directory as sys.path[0] (as it is here already).
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if not isinstance(exc.code, (int, type(None))):
            _report(exc)  # sys.exit("message"): say where; an exit code speaks for itself
        raise
    except KeyboardInterrupt:
        return 130  # Ctrl-C: the launcher says so once, for every rank
    except BaseException as exc:
        _report(exc)
        return 1
    return 0


def _die_with_launcher() -> None:
    """A launcher killed with SIGKILL takes this worker along (see :func:`accelkit._launcher.die_with_parent`)."""
    from .._env import LAUNCHER_PID, read_int
    from .._launcher import die_with_parent

    launcher = read_int(LAUNCHER_PID)
    if launcher is not None:
        die_with_parent(launcher)


def _record_stacks() -> None:
    """A death by signal (a backend's abort, SIGTERM) shows where it was."""
    from .._env import RUN_DIR

    run_dir = os.environ.get(RUN_DIR)
    if run_dir:
        from .._rundir import record_stacks

        record_stacks(run_dir)


def _report(exc: BaseException) -> None:
    """Print the traceback as Python would, then write the failure record for the launcher."""
    text = _frames.user_traceback(exc, _RUNPY, keep_last=False)  # the user's code first
    if not isinstance(exc, SystemExit):
        sys.stderr.write(text)
        sys.stderr.flush()
    from .._rundir import record_failure

    record_failure(exc, text)
    if "accelkit._state" in sys.modules:  # the script started trackers only if it imported the state
        from .. import _state

        _state.stop_upkeep(exc)  # a rank still waiting for this one reads that it is gone, and why
        _state.this_process.end_tracking(failed=True)  # what was logged stays readable, and the run is marked failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
