"""Each worker's failure record: written where it fails, read by the launcher that started it.

A worker records its exception (type, message, the traceback from the user's code, where it was, the
time) in the run's directory before it dies, so that the launcher names every failed rank, root cause
first, whatever the elastic agent (or mpirun) noticed first. One writer, :func:`record_failure`, serves
every place a worker fails: its function or script raised, its heartbeat found that no rank can go on,
a background save failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from .. import _env, _frames, _safe_io
from ..errors import ConfigurationError
from ._spot import spot_of

__all__ = ["exception_name", "lost_peer", "read_failures", "record_failure"]

_FOLDER = "failures"


def record_failure(exc: BaseException, text: str | None = None, run_dir: str | None = None) -> None:
    """Write this worker's failure record atomically into the run directory (``ACCELKIT_RUN_DIR`` unless
    ``run_dir`` is given); nothing outside a launcher. ``text`` replaces the traceback from the user's code.

    Never raises: a record that cannot be written is said on stderr (the exit code still tells the launcher).
    """
    run_dir = run_dir or os.environ.get(_env.RUN_DIR)
    if not run_dir:
        return
    try:
        where = _env.detect_launch()  # torchrun's variables, or mpirun's
    except ConfigurationError:
        where = _env.LaunchEnv("none")
    # Before the agent's variables are set (a spawned worker still importing the main module) the rank
    # is unknown: the report is then matched to its rank by pid.
    rank = where.rank if where.launcher != "none" else None
    spot = spot_of([(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(exc.__traceback__)])
    report = {
        "rank": rank,
        "local_rank": where.local_rank,
        "pid": os.getpid(),
        "exc_type": exception_name(exc),
        "message": str(exc),
        "traceback": text if text is not None else _frames.user_traceback(exc),
        "timestamp": time.time(),
        "lost_peer": lost_peer(exc),
        "spot": list(spot) if spot is not None else None,
    }
    folder = Path(run_dir, _FOLDER, f"attempt{where.restart_count}")
    name = f"rank{rank}.json" if rank is not None else f"pid{os.getpid()}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _safe_io.write_atomic(folder / name, json.dumps(report).encode())
    except OSError as err:
        sys.stderr.write(f"accelkit: could not record the failure for the launcher: {err!r}\n")


def read_failures(run_dir: str) -> tuple[str, list[dict[str, Any]]]:
    """The records of the last attempt that left any: its folder's name (``attempt<N>``, "" when none), and them."""
    root = os.path.join(run_dir, _FOLDER)
    attempts = sorted(os.listdir(root), key=lambda a: int(a[7:])) if os.path.isdir(root) else []
    if not attempts:
        return "", []
    last = os.path.join(root, attempts[-1])
    records = []
    for name in sorted(os.listdir(last)):
        if name.endswith(".json"):
            with open(os.path.join(last, name)) as f:
                records.append(json.load(f))
    return attempts[-1], records


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
