"""Checkpoints that survive crashes: atomic save, verified safe load, exact resume."""

from ..errors import CheckpointError
from ._api import latest_checkpoint, load_state, save_state
from ._export import save_model

__all__ = ["CheckpointError", "latest_checkpoint", "load_state", "save_model", "save_state"]
