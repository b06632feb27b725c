"""What the launcher sends to workers: the target to run and everything a worker needs.

Torch-free, so that the notebook checks, the rendezvous and the agent share these types
without importing each other.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Command", "FunctionRef", "HandlerSetup", "Job", "LoggingSetup"]


@dataclass(frozen=True)
class FunctionRef:
    """A module-level function named by module and qualified name (resolved in the worker)."""

    module: str
    qualname: str

    def resolve(self) -> Callable[..., Any]:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Command:
    """A Python program the workers run: ``python ARGV...`` (``accelkit launch``'s script)."""

    argv: tuple[str, ...]


@dataclass(frozen=True)
class Job:
    """Everything one worker needs; pickled to spawned workers."""

    target: Callable[..., Any] | FunctionRef
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    run_dir: str
    env: dict[str, str] = field(default_factory=dict)
    threads: int | None = None
    watchdog: float | None = None
    logging: LoggingSetup | None = None  # the launching process's logging, for spawned workers
    launcher_pid: int | None = None  # the process that started the workers: they die with it


@dataclass(frozen=True)
class HandlerSetup:
    """One handler of the root logger: where it writes, its level and format."""

    stream: str  # "stderr", "stdout", or "file"
    filename: str | None
    level: int
    fmt: str | None
    datefmt: str | None
    style: str


@dataclass(frozen=True)
class LoggingSetup:
    """What ``logging.basicConfig(...)`` and ``setLevel`` did in the launching process, to do again in a worker."""

    root_level: int
    handlers: tuple[HandlerSetup, ...]
    levels: dict[str, int]  # named loggers with a level of their own
