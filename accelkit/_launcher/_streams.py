"""Workers' output: each rank's prints reach a notebook cell as whole lines, and spawned workers
log as the launching process configured logging (``logging.basicConfig`` under ``__main__``)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

from ._spec import HandlerSetup, LoggingSetup

__all__ = ["apply_logging", "capture_logging", "flush_std_streams", "whole_lines_to_notebook"]

_STYLES = {logging.PercentStyle: "%", logging.StrFormatStyle: "{", logging.StringTemplateStyle: "$"}


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


def capture_logging() -> LoggingSetup:
    """The root logger's level and its stream and file handlers, and the levels set on named loggers."""
    handlers = []
    for handler in logging.root.handlers:
        formatter = handler.formatter
        fmt, style = (formatter._fmt, _STYLES.get(type(formatter._style), "%")) if formatter else (None, "%")
        datefmt = formatter.datefmt if formatter else None
        if isinstance(handler, logging.FileHandler):
            spec = HandlerSetup("file", handler.baseFilename, handler.level, fmt, datefmt, style)
        elif isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.stderr):
            name = "stdout" if handler.stream is sys.stdout else "stderr"
            spec = HandlerSetup(name, None, handler.level, fmt, datefmt, style)
        else:
            continue  # a handler of its own kind cannot be rebuilt from here
        handlers.append(spec)
    levels = {
        name: logger.level
        for name, logger in logging.root.manager.loggerDict.items()
        if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET
    }
    return LoggingSetup(logging.root.level, tuple(handlers), levels)


def apply_logging(setup: LoggingSetup) -> None:
    """In a spawned worker: configure logging like the launching process, and name its main module ``__main__``."""
    main_logger = logging.root.manager.loggerDict.get("__mp_main__")
    if isinstance(main_logger, logging.Logger):  # the script's `getLogger(__name__)`, imported as __mp_main__
        main_logger.name = "__main__"
    for name, level in setup.levels.items():
        logging.getLogger("__main__" if name == "__mp_main__" else name).setLevel(level)
    if logging.root.handlers:  # the worker configured logging itself (e.g. at import): leave it
        return
    logging.root.setLevel(setup.root_level)
    for spec in setup.handlers:
        handler: logging.Handler
        if spec.stream == "file" and spec.filename:
            handler = logging.FileHandler(spec.filename, mode="a")
        else:
            handler = logging.StreamHandler(sys.stdout if spec.stream == "stdout" else sys.stderr)
        handler.setLevel(spec.level)
        handler.setFormatter(logging.Formatter(spec.fmt, spec.datefmt, style=spec.style))  # type: ignore[arg-type]
        logging.root.addHandler(handler)
