"""The ``"wandb"`` tracker: a Weights & Biases run (``pip install "accelkit[wandb]"``).

Its files go under the run's directory (``wandb/``); ``WANDB_MODE=offline`` keeps everything
local (``wandb sync`` uploads it later). ``init_kwargs={"wandb": {...}}`` go to ``wandb.init``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["WandbTracker", "start"]


class WandbTracker:
    """One W&B run; ``ak.get_tracker("wandb")`` returns it."""

    def __init__(self, run: Any) -> None:
        self.writer = run

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.writer.log(dict(values), step=step)

    def finish(self, failed: bool) -> None:
        self.writer.finish(exit_code=1 if failed else 0)


def start(directory: Path, project: str, config: Mapping[str, Any], options: dict[str, Any]) -> WandbTracker:
    """``wandb.init(project=project, dir=directory, config=config, **options)``."""
    import wandb  # type: ignore[import-not-found,unused-ignore]

    settings = {"project": project, "dir": str(directory), "config": dict(config) or None, **options}
    return WandbTracker(wandb.init(**settings))
