"""Where a rank was, read off its stack: the user's line, and the accelkit call it was in.

A stack comes from an exception's traceback (a worker that raised) or from the Python stacks a worker left
when it died from a signal or was stopped (:mod:`._stacks`). Torch-free.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Spot", "spot_of", "spot_of_dump"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = f"{os.sep}torch{os.sep}"
_NOT_USER = ("<frozen ", "<string>")  # runpy's and the launchers' entry code
# faulthandler's frame lines: `  File "train.py", line 14 in main`
_DUMPED = re.compile(r'^\s*File "(.*)", line (\d+) in (\S+)')


class Spot(NamedTuple):
    """The user's line (``file:line in function``) and the accelkit function it called, "" if none.

    Example:
        >>> print(Spot("ak.reduce", "train.py:16 in main"))
        ak.reduce at train.py:16 in main
    """

    call: str
    line: str

    def __str__(self) -> str:
        return f"{self.call} at {self.line}" if self.call else self.line


def spot_of(frames: Sequence[tuple[str, int, str]]) -> Spot | None:
    """The spot of a stack given as ``(filename, line, function)``, outermost first; None without user code."""
    for i in range(len(frames) - 1, -1, -1):
        filename, line, function = frames[i]
        if _is_user(filename):
            inner = frames[i + 1] if i + 1 < len(frames) else None
            call = _public(inner[2]) if inner is not None and _is_ours(inner[0]) else ""
            return Spot(call, f"{filename}:{line} in {function}")
    return None


def spot_of_dump(block: str) -> Spot | None:
    """The spot of one thread's stack as faulthandler writes it (most recent call first)."""
    frames = [(m[1], int(m[2]), m[3]) for m in map(_DUMPED.match, block.splitlines()) if m]
    return spot_of(frames[::-1])


def _public(function: str) -> str:
    """``ak.reduce`` for a public function of accelkit's; "inside accelkit" for any other of its frames."""
    names = getattr(sys.modules.get("accelkit"), "__all__", ())  # the package is imported: accelkit code ran
    return f"ak.{function}" if function in names else "inside accelkit"


def _is_ours(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE)


def _is_user(filename: str) -> bool:
    return not (_is_ours(filename) or _TORCH in filename or filename.startswith(_NOT_USER))
