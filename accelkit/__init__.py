"""accelkit: one PyTorch training script on a CPU, a GPU, many GPUs or many machines.

Names are loaded on first use, so that ``accelkit --help`` needs no torch import.

Example:
    >>> import accelkit as ak
    >>> ak.world_size()
    1
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:  # the names for type checkers and IDEs; at run time they load on first use
    from ._checkpoint import (
        CheckpointInfo,
        full_state_dict,
        latest_checkpoint,
        load_state,
        read_checkpoint,
        save_model,
        save_state,
        wait_for_checkpoint,
    )
    from ._collectives import broadcast, broadcast_object, gather, gather_object, pad_across_processes, reduce
    from ._config import write_basic_config
    from ._data import gather_for_metrics, skip_first_batches
    from ._launcher import distributed, launch
    from ._memory import find_executable_batch_size, free_memory
    from ._process import (
        check_breakpoint,
        device,
        is_local_main_process,
        is_main_process,
        local_main_process_first,
        local_rank,
        main_process_first,
        mesh,
        on_local_main_process,
        on_main_process,
        on_process,
        print,
        rank,
        set_breakpoint,
        set_seed,
        state,
        strategy,
        wait_for_everyone,
        world_size,
    )
    from ._split import split_between_processes
    from ._state import ProcessState, init, is_initialized, reset_state
    from ._tracking import end_training, get_tracker, init_trackers, log, profile, progress
    from ._training import (
        accumulate,
        backward,
        clip_grad_norm_,
        clip_grad_value_,
        local_sgd,
        no_sync,
        precision,
        prepare,
        sync_gradients,
        unwrap,
    )
    from .errors import (
        CheckpointError,
        ConfigurationError,
        DistributedOperationError,
        NoExecutableBatchSizeError,
        StateError,
        WorkerError,
    )
    from .logging import get_logger

# public name -> the module that defines it
_HOMES: dict[str, str] = {
    "CheckpointError": ".errors",
    "precision": "._training",
    "prepare": "._training",
    "ProcessState": "._state",
    "init": "._state",
    "is_initialized": "._state",
    "reset_state": "._state",
    "latest_checkpoint": "._checkpoint",
    "load_state": "._checkpoint",
    "save_model": "._checkpoint",
    "save_state": "._checkpoint",
    "CheckpointInfo": "._checkpoint",
    "full_state_dict": "._checkpoint",
    "read_checkpoint": "._checkpoint",
    "wait_for_checkpoint": "._checkpoint",
    "broadcast": "._collectives",
    "broadcast_object": "._collectives",
    "gather": "._collectives",
    "gather_object": "._collectives",
    "pad_across_processes": "._collectives",
    "reduce": "._collectives",
    "gather_for_metrics": "._data",
    "skip_first_batches": "._data",
    "ConfigurationError": ".errors",
    "DistributedOperationError": ".errors",
    "NoExecutableBatchSizeError": ".errors",
    "StateError": ".errors",
    "WorkerError": ".errors",
    "distributed": "._launcher",
    "launch": "._launcher",
    "get_logger": ".logging",
    "find_executable_batch_size": "._memory",
    "free_memory": "._memory",
    "check_breakpoint": "._process",
    "device": "._process",
    "is_local_main_process": "._process",
    "is_main_process": "._process",
    "local_main_process_first": "._process",
    "local_rank": "._process",
    "main_process_first": "._process",
    "mesh": "._process",
    "on_local_main_process": "._process",
    "on_main_process": "._process",
    "on_process": "._process",
    "print": "._process",
    "rank": "._process",
    "set_breakpoint": "._process",
    "set_seed": "._process",
    "state": "._process",
    "strategy": "._process",
    "wait_for_everyone": "._process",
    "world_size": "._process",
    "split_between_processes": "._split",
    "accumulate": "._training",
    "backward": "._training",
    "clip_grad_norm_": "._training",
    "clip_grad_value_": "._training",
    "local_sgd": "._training",
    "no_sync": "._training",
    "sync_gradients": "._training",
    "unwrap": "._training",
    "write_basic_config": "._config",
    "end_training": "._tracking",
    "get_tracker": "._tracking",
    "init_trackers": "._tracking",
    "log": "._tracking",
    "profile": "._tracking",
    "progress": "._tracking",
}

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ConfigurationError",
    "DistributedOperationError",
    "NoExecutableBatchSizeError",
    "ProcessState",
    "StateError",
    "WorkerError",
    "__version__",
    "accumulate",
    "backward",
    "broadcast",
    "broadcast_object",
    "check_breakpoint",
    "clip_grad_norm_",
    "clip_grad_value_",
    "device",
    "distributed",
    "end_training",
    "find_executable_batch_size",
    "free_memory",
    "full_state_dict",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "get_tracker",
    "init",
    "init_trackers",
    "is_initialized",
    "is_local_main_process",
    "is_main_process",
    "latest_checkpoint",
    "launch",
    "load_state",
    "local_main_process_first",
    "local_rank",
    "local_sgd",
    "log",
    "main_process_first",
    "mesh",
    "no_sync",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "pad_across_processes",
    "precision",
    "prepare",
    "print",
    "profile",
    "progress",
    "rank",
    "read_checkpoint",
    "reduce",
    "reset_state",
    "save_model",
    "save_state",
    "set_breakpoint",
    "set_seed",
    "skip_first_batches",
    "split_between_processes",
    "state",
    "strategy",
    "sync_gradients",
    "unwrap",
    "wait_for_checkpoint",
    "wait_for_everyone",
    "world_size",
    "write_basic_config",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None and name.startswith("_"):  # a private name (a submodule's, while ``from . import _x`` runs)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if home is None:  # Accelerate's spelling of an accelkit name gets accelkit's in the message
        from ._accelerate_names import missing_name

        raise AttributeError(missing_name(name, __all__))
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # The public names and the module's own dunders; not the helpers this module imports (Any, importlib, ...).
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__))
