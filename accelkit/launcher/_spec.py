"""What the launcher sends to workers: the target to run and everything a worker needs.

Torch-free, so that the notebook checks, the rendezvous and the agent share these types
without importing each other.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Command", "FunctionRef", "Job"]


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
    launcher_pid: int | None = None  # the process that started the workers: they die with it
