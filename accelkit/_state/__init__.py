"""The one process-global of accelkit: a frozen snapshot of where this process stands, and the
records of training, of the process group and of the running trackers, held by one object.

Built lazily on first use, guarded by a lock, forgotten by :func:`reset_state` or when the
process id changes (a forked child never reuses its parent's state or process group).
``training`` and ``group`` are the same objects for the life of the process (reset in place).
"""

from ._build import configure, explicit_options, get, init, own_step, reform_group, strategy
from ._globals import (
    ProcessGlobals,
    close_group,
    group,
    hooks,
    is_initialized,
    new_task,
    origin,
    peek,
    reset_state,
    stop_upkeep,
    this_process,
    training,
)
from ._records import NOWHERE, GroupState, Now, ProcessState, TrainingState

__all__ = [
    "NOWHERE",
    "GroupState",
    "Now",
    "ProcessGlobals",
    "ProcessState",
    "TrainingState",
    "close_group",
    "configure",
    "explicit_options",
    "get",
    "group",
    "hooks",
    "init",
    "is_initialized",
    "new_task",
    "origin",
    "own_step",
    "peek",
    "reform_group",
    "reset_state",
    "stop_upkeep",
    "strategy",
    "this_process",
    "training",
]
