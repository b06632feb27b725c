"""Prepared DataLoaders: this rank's shard of every epoch, on the device; ``gather_for_metrics``."""

from ._build import gather_for_metrics, prepare_dataloader, skip_first_batches
from ._loader import PreparedDataLoader

__all__ = ["PreparedDataLoader", "gather_for_metrics", "prepare_dataloader", "skip_first_batches"]
