"""The ``"tensorboard"`` tracker: event files that ``tensorboard --logdir runs`` shows.

Through ``torch.utils.tensorboard`` (``pip install "accelkit[tensorboard]"``). The config goes
into the run itself as hyper-parameters (TensorBoard's HParams tab), not into a sub-run as
``SummaryWriter.add_hparams`` would put it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._values import flat_hparams

__all__ = ["TensorBoardTracker", "start"]


class TensorBoardTracker:
    """One ``SummaryWriter`` writing into the run's directory."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)
        # The writer's thread would hold the events up to two minutes: a killed worker would lose them.
        self.writer.flush()

    def finish(self, failed: bool) -> None:
        self.writer.close()


def start(directory: Path, project: str, config: Mapping[str, Any], options: dict[str, Any]) -> TensorBoardTracker:
    """A writer in ``directory``; ``options`` go to ``SummaryWriter`` (e.g. ``flush_secs``)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory), **options)
    if config:
        from torch.utils.tensorboard.summary import hparams

        file_writer: Any = writer.file_writer
        for summary in hparams(flat_hparams(config), {}):  # type: ignore[no-untyped-call]
            file_writer.add_summary(summary)
        writer.flush()
    return TensorBoardTracker(writer)
