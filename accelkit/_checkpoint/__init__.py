"""Checkpoints that survive crashes: atomic save, verified safe load, exact resume."""

from ..errors import CheckpointError
from ._export import save_model
from ._info import CheckpointInfo, read_checkpoint
from ._save_load import (
    finish_saving,
    full_state_dict,
    latest_checkpoint,
    load_state,
    save_state,
    wait_for_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "finish_saving",
    "full_state_dict",
    "latest_checkpoint",
    "load_state",
    "read_checkpoint",
    "save_model",
    "save_state",
    "wait_for_checkpoint",
]
