"""The ``"csv"`` tracker: ``metrics.csv`` (``run`` and ``step`` columns, then one per name) and ``config.json``.

Standard library only. Each ``ak.log`` call is one row, flushed before it returns; a name seen
for the first time adds a column (the file is rewritten once, atomically, with the wider
header). A file left by an earlier run of the same project is continued, not replaced: the
``run`` column tells the runs apart (1, 2, ...; a job restarted by ``max_restarts`` keeps its
run, its steps go on).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from .. import _safe_io
from ._values import last_line, next_run, start_file_tracker

__all__ = ["CsvTracker", "start"]

_KEYS = ["run", "step"]


class CsvTracker:
    """Appends one row per ``ak.log`` call to ``metrics.csv``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: list[str] = list(_KEYS)
        last = None
        if path.is_file() and path.stat().st_size:
            with path.open(newline="", encoding="utf-8") as f:
                self.columns = next(csv.reader(f), []) or self.columns
            if self.columns[:2] != _KEYS:  # written before runs were told apart: their rows get no run
                self.columns = _KEYS + [c for c in self.columns if c != "step"]
                self._rewrite(lambda row: ["", *row])
            last = _int(next(csv.reader([last_line(path)]), [""])[0])
        self.run = next_run(last)
        self._open()
        if self.columns == _KEYS and not path.stat().st_size:
            self._write([self.columns])

    @property
    def writer(self) -> Path:
        """The CSV file's path."""
        return self.path

    def log(self, values: Mapping[str, float], step: int) -> None:
        new = [name for name in values if name not in self._known]
        if new:
            self._file.close()
            self.columns += new
            self._rewrite(lambda row: row + [""] * (len(self.columns) - len(row)))
            self._open()
        self._write([[self.run, step, *(values.get(c, "") for c in self.columns[2:])]])

    def finish(self, failed: bool) -> None:
        self._file.close()

    def _open(self) -> None:
        self._file: IO[str] = self.path.open("a", newline="", encoding="utf-8")
        self._rows = csv.writer(self._file)
        self._known = set(self.columns)

    def _write(self, rows: list[list[Any]]) -> None:
        self._rows.writerows(rows)
        self._file.flush()  # in the OS's hands: a worker killed next still leaves the row on disk

    def _rewrite(self, fix: Callable[[list[str]], list[str]]) -> None:
        """The file again, atomically, with the current header and ``fix`` applied to each row."""
        with self.path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))[1:]
        text = io.StringIO(newline="")
        csv.writer(text).writerows([self.columns, *(fix(row) for row in rows)])
        _safe_io.write_atomic(self.path, text.getvalue().encode("utf-8"))


def _int(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def start(directory: Path, project: str, config: Mapping[str, Any], options: dict[str, Any]) -> CsvTracker:
    """``metrics.csv`` in ``directory`` (and ``config.json`` when there is a config); no options."""
    start_file_tracker("csv", directory, config, options)
    return CsvTracker(directory / "metrics.csv")
