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
    from ._state import ProcessState, init, is_initialized, reset_state
    from .checkpoint import (
        CheckpointInfo,
        full_state_dict,
        latest_checkpoint,
        load_state,
        read_checkpoint,
        save_model,
        save_state,
        wait_for_checkpoint,
    )
    from .collectives import broadcast, broadcast_object, gather, gather_object, pad_across_processes, reduce
    from .config import write_basic_config
    from .data import gather_for_metrics, skip_first_batches
    from .errors import (
        CheckpointError,
        ConfigurationError,
        DistributedOperationError,
        NoExecutableBatchSizeError,
        StateError,
        WorkerError,
    )
    from .launcher import distributed, launch
    from .logging import get_logger
    from .memory import find_executable_batch_size, free_memory
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
        strategy,
        wait_for_everyone,
        world_size,
    )
    from .split import split_between_processes
    from .tracking import end_training, get_tracker, init_trackers, log, profile, progress
    from .training import (
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

# public name -> the module that defines it
_HOMES: dict[str, str] = {
    "CheckpointError": ".errors",
    "precision": ".training",
    "prepare": ".training",
    "ProcessState": "._state",
    "init": "._state",
    "is_initialized": "._state",
    "reset_state": "._state",
    "latest_checkpoint": ".checkpoint",
    "load_state": ".checkpoint",
    "save_model": ".checkpoint",
    "save_state": ".checkpoint",
    "CheckpointInfo": ".checkpoint",
    "full_state_dict": ".checkpoint",
    "read_checkpoint": ".checkpoint",
    "wait_for_checkpoint": ".checkpoint",
    "broadcast": ".collectives",
    "broadcast_object": ".collectives",
    "gather": ".collectives",
    "gather_object": ".collectives",
    "pad_across_processes": ".collectives",
    "reduce": ".collectives",
    "gather_for_metrics": ".data",
    "skip_first_batches": ".data",
    "ConfigurationError": ".errors",
    "DistributedOperationError": ".errors",
    "NoExecutableBatchSizeError": ".errors",
    "StateError": ".errors",
    "WorkerError": ".errors",
    "distributed": ".launcher",
    "launch": ".launcher",
    "get_logger": ".logging",
    "find_executable_batch_size": ".memory",
    "free_memory": ".memory",
    "check_breakpoint": ".process",
    "device": ".process",
    "is_local_main_process": ".process",
    "is_main_process": ".process",
    "local_main_process_first": ".process",
    "local_rank": ".process",
    "main_process_first": ".process",
    "on_local_main_process": ".process",
    "on_main_process": ".process",
    "on_process": ".process",
    "print": ".process",
    "rank": ".process",
    "set_breakpoint": ".process",
    "set_seed": ".process",
    "state": ".process",
    "strategy": ".process",
    "wait_for_everyone": ".process",
    "world_size": ".process",
    "split_between_processes": ".split",
    "accumulate": ".training",
    "backward": ".training",
    "clip_grad_norm_": ".training",
    "clip_grad_value_": ".training",
    "local_sgd": ".training",
    "no_sync": ".training",
    "sync_gradients": ".training",
    "unwrap": ".training",
    "write_basic_config": ".config",
    "end_training": ".tracking",
    "get_tracker": ".tracking",
    "init_trackers": ".tracking",
    "log": ".tracking",
    "profile": ".tracking",
    "progress": ".tracking",
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
