"""accelkit: one PyTorch training script on a CPU, a GPU, many GPUs or many machines.

Example:
    >>> import accelkit as ak
    >>> ak.world_size()
    1
"""

from ._state import ProcessState, init, is_initialized, reset_state
from ._version import __version__
from .errors import ConfigurationError, DistributedOperationError, StateError, WorkerError
from .launcher import distributed, launch
from .logging import get_logger
from .process import (
    check_breakpoint,
    device,
    is_local_main_process,
    is_main_process,
    local_main_process_first,
    local_rank,
    main_process_first,
    on_local_main_process,
    on_main_process,
    on_process,
    print,
    rank,
    set_breakpoint,
    set_seed,
    state,
    wait_for_everyone,
    world_size,
)
from .split import split_between_processes

__all__ = [
    "ConfigurationError",
    "DistributedOperationError",
    "ProcessState",
    "StateError",
    "WorkerError",
    "__version__",
    "check_breakpoint",
    "device",
    "distributed",
    "get_logger",
    "init",
    "is_initialized",
    "is_local_main_process",
    "is_main_process",
    "launch",
    "local_main_process_first",
    "local_rank",
    "main_process_first",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "print",
    "rank",
    "reset_state",
    "set_breakpoint",
    "set_seed",
    "split_between_processes",
    "state",
    "wait_for_everyone",
    "world_size",
]
