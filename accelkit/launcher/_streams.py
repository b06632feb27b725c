"""Workers' output: each rank's prints reach a notebook cell as whole lines."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

__all__ = ["flush_std_streams", "whole_lines_to_notebook"]


class _LineWriter:
    """Passes whole lines (and whatever is pending at ``flush``) on to ``stream``."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self._stream.write(lines + "\n")
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, ... of the stream
        return getattr(self._stream, name)


def whole_lines_to_notebook() -> None:
    """In a worker forked from a Jupyter kernel, hand the kernel's streams whole lines."""
    # ipykernel's OutStream sends every write as its own message, so print("loss", x) from two
    # ranks arrives interleaved word by word. Whole lines keep each rank's lines intact; they
    # still reach the cell at once.
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if type(stream).__module__.startswith("ipykernel."):
            setattr(sys, name, _LineWriter(stream))


def flush_std_streams() -> None:
    """Flush this process's stdout and stderr (before forking: children would print them again)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
