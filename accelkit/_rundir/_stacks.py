"""Where a worker was when it died from a signal: ``faulthandler``'s stacks, kept in the run directory.

Armed in every worker before the user's code runs (``accelkit launch`` scripts too), importing nothing
beyond the standard library. A fatal signal (SIGSEGV, SIGABRT: a backend that aborts) leaves the stacks
of every thread; so does SIGTERM, with which a launcher stops the other workers after one failed, so
that the failure report can say where each rank was, not only that it was stopped.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from ._spot import Spot, spot_of_dump

__all__ = ["record_stacks", "stacks_of", "where_each_was", "where_it_was"]

_FOLDER = "crashes"
_RANK = "rank "  # the first line of a file: the rank whose stacks follow
_LINES = 80  # of the Python stacks a signal left: the crashing thread's come first
_file: Any = None  # open for as long as the process lives: faulthandler writes to its descriptor


def record_stacks(run_dir: str) -> None:
    """Where this worker dies from a fatal signal or is stopped by SIGTERM, its Python stacks go to the run
    directory, where the launcher finds them (:func:`stacks_of`).

    A process that has ``faulthandler`` on already (``PYTHONFAULTHANDLER``, ``-X faulthandler``) keeps it as
    it is. SIGTERM still ends the process as before (the dump is chained to the handler in place).
    """
    global _file
    import faulthandler

    if faulthandler.is_enabled():
        return
    folder = os.path.join(run_dir, _FOLDER)
    os.makedirs(folder, exist_ok=True)
    _file = open(os.path.join(folder, f"{os.getpid()}.txt"), "w")
    _file.write(f"{_RANK}{os.environ.get('RANK', '')}\n\n")  # whose stacks (the launcher set RANK)
    _file.flush()
    faulthandler.enable(_file, all_threads=True)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a handler of the program's own stays alone
        faulthandler.register(signal.SIGTERM, _file, all_threads=True, chain=True)


def _text(run_dir: str, pid: int | str | None) -> str:
    """The stacks file of process ``pid`` ("" if it left none)."""
    try:
        with open(os.path.join(run_dir, _FOLDER, f"{pid}.txt")) as f:
            return f.read()
    except OSError:
        return ""


def _blocks(text: str) -> list[str]:
    return [b for b in text.strip().split("\n\n") if b and not b.startswith(("Extension modules:", _RANK))]


def stacks_of(run_dir: str, pid: int | None, main_only: bool = False) -> str:
    """What :func:`record_stacks` caught in process ``pid``: the error, the main thread's stack, then the other
    threads' (``main_only``: the main thread's alone); "" if nothing."""
    blocks = _blocks(_text(run_dir, pid))
    blocks.sort(key=lambda b: (not b.startswith("Fatal Python error"), " in <module>" not in b))  # stable
    if main_only:
        blocks = [b for b in blocks if " in <module>" in b][:1]
    return "\n".join("\n\n".join(blocks).splitlines()[:_LINES])


def where_each_was(run_dir: str) -> dict[int, Spot]:
    """Where each rank that left stacks was (its main thread), by rank: those the launcher stopped with SIGTERM
    too, which some torch versions' agents do not list among the failures."""
    found: dict[int, Spot] = {}
    folder = os.path.join(run_dir, _FOLDER)
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        pid = name.removesuffix(".txt")
        text = _text(run_dir, pid)  # read once: its first line names the rank, the rest are its stacks
        head = text.split("\n", 1)[0].strip()
        rank = head.removeprefix(_RANK)
        spot = _main_thread(_blocks(text)) if head.startswith(_RANK) and rank.isdigit() and pid.isdigit() else None
        if spot is not None:
            found[int(rank)] = spot
    return found


def where_it_was(run_dir: str, pid: int | None) -> Spot | None:
    """Where the main thread of process ``pid`` was when a signal ended it (the thread that runs ``<module>``)."""
    return _main_thread(_blocks(_text(run_dir, pid)))


def _main_thread(blocks: list[str]) -> Spot | None:
    for block in blocks:
        if " in <module>" in block:
            return spot_of_dump(block)
    return None
