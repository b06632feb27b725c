"""The ``"jsonl"`` tracker: ``metrics.jsonl``, one JSON object per ``ak.log`` call, and ``config.json``.

Standard library only. Each line is ``{"run": 1, "step": 3, "loss": 0.25, "eval/acc": 0.9}``,
flushed before ``ak.log`` returns (NaN and infinities are written as the strings ``"nan"``,
``"inf"``). A file left by an earlier run of the same project is continued, not replaced: ``run``
tells the runs apart (1, 2, ...; a job restarted by ``max_restarts`` keeps its run).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from ._values import json_number, last_line, next_run, start_file_tracker

__all__ = ["JsonlTracker", "start"]


class JsonlTracker:
    """Appends one line per ``ak.log`` call to ``metrics.jsonl``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.run = next_run(_last_run(path))
        self._file: IO[str] = path.open("a", encoding="utf-8")

    @property
    def writer(self) -> Path:
        """The JSONL file's path."""
        return self.path

    def log(self, values: Mapping[str, float], step: int) -> None:
        row = {"run": self.run, "step": step, **{name: json_number(value) for name, value in values.items()}}
        self._file.write(json.dumps(row) + "\n")  # default arguments: json's cached encoder, ~10x faster
        self._file.flush()  # in the OS's hands: a worker killed next still leaves the line on disk

    def finish(self, failed: bool) -> None:
        self._file.close()


def _last_run(path: Path) -> int | None:
    """The run of the file's last line; None without one (or one written before runs were told apart)."""
    if not path.is_file():
        return None
    try:
        run = json.loads(last_line(path) or "{}").get("run")
    except (ValueError, AttributeError):  # a line cut short by a crash, or not an object
        return None
    return run if isinstance(run, int) else None


def start(directory: Path, project: str, config: Mapping[str, Any], options: dict[str, Any]) -> JsonlTracker:
    """``metrics.jsonl`` in ``directory`` (and ``config.json`` when there is a config); no options."""
    start_file_tracker("jsonl", directory, config, options)
    return JsonlTracker(directory / "metrics.jsonl")
