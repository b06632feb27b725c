"""Where the user's code is: the first caller outside accelkit, and tracebacks that start there.

Error messages name the line of the user's own call (``ak.init`` at ``train.py:12``), and
worker failure reports show the user's frames first, not accelkit's entry points.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterable
from types import FrameType

PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _skipped(filename: str, skip: Iterable[str]) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(PACKAGE) or filename in skip or path in skip


def is_ours(filename: str) -> bool:
    """Whether ``filename`` is one of accelkit's modules."""
    return _skipped(filename, ())


def user_frame(skip: Iterable[str] = ()) -> FrameType | None:
    """The innermost frame of the caller's stack that is not accelkit's (nor in ``skip``)."""
    skip = tuple(skip)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _skipped(frame.f_code.co_filename, skip):
        frame = frame.f_back
    return frame


def call_site(skip: Iterable[str] = ()) -> str:
    """``file:line in function`` of the user's code that called into accelkit.

    Example:
        >>> call_site().startswith("<doctest")
        True
    """
    frame = user_frame(skip)
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def user_traceback(exc: BaseException, skip: Iterable[str] = (), keep_last: bool = True) -> str:
    """``exc``'s formatted traceback without the leading frames of accelkit (and of ``skip``).

    With ``keep_last`` the innermost frame stays even when it is accelkit's (it raised), so the
    reader sees where; without, a traceback of only skipped frames keeps none (a SyntaxError
    in a script shows just the bad line, as Python does).
    """
    skip = tuple(skip)
    summary = traceback.TracebackException.from_exception(exc)
    stack = list(summary.stack)
    while len(stack) > int(keep_last) and _skipped(stack[0].filename, skip):
        stack.pop(0)
    summary.stack = traceback.StackSummary.from_list(stack)
    return "".join(summary.format())
