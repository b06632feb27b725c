"""Launching from a notebook: refusing what forked workers cannot use, and debug mode's pre-flight."""

from __future__ import annotations

import sys

from .. import _state
from .._options import LaunchSettings
from ..errors import StateError, WorkerError
from ._agent import run_workers

__all__ = ["preflight_launch", "refuse_unsafe_fork"]


# Imported by users before a launch, these initialise CUDA in the importing process (or may).
_CUDA_INITIALISERS = ("bitsandbytes", "deepspeed", "apex", "xformers", "flash_attn", "vllm", "cupy", "pycuda", "jax")


def refuse_unsafe_fork(world_size: int) -> None:
    """Forked workers inherit this process: refuse what they cannot use (CUDA, a process group)."""
    import torch

    cannot = f"accelkit.launch cannot fork {world_size} worker processes"
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise StateError(
            f"{cannot}: CUDA was already initialised in this process{_cuda_suspects()}, and forked "
            f"workers cannot use it. Restart the kernel (or interpreter) and keep all CUDA work "
            f"(.cuda(), .to('cuda'), ak.prepare, torch.cuda calls) inside the launched function."
        )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        user = ""
        if _state.is_initialized():
            st = _state.get()
            where = f"rank {st.rank} of {st.world_size}, created at {_state.origin()}"
            user = f"; accelkit's state in this process ({where}) uses it"
        raise StateError(
            f"{cannot}: a torch.distributed process group already exists in this process{user}, and "
            f"forked workers cannot share it. Call torch.distributed.destroy_process_group() and "
            f"ak.reset_state() first, or restart the kernel; keep process-group work inside the launched function."
        )


def _cuda_suspects() -> str:
    found = [name for name in _CUDA_INITIALISERS if name in sys.modules]
    if _state.is_initialized() and _state.get().device.type == "cuda":
        found.insert(0, f"accelkit (its state uses {_state.get().device}, created at {_state.origin()})")
    if found:
        return f" (likely by {', '.join(found)})"
    return " (by a cell run earlier: .cuda(), .to('cuda'), a torch.cuda call or an import that does so)"


def _preflight() -> None:
    """Debug mode's dry run in every worker: join the process group, meet at a barrier."""
    from .._process import wait_for_everyone

    _state.get()
    wait_for_everyone()


def preflight_launch(config: LaunchSettings, env: dict[str, str]) -> None:
    """Debug mode: a dry launch with ``config`` (group and barrier) before the real one."""
    try:
        run_workers(_preflight, (), {}, config, env)
    except WorkerError as exc:
        if sys.version_info >= (3, 11):
            exc.add_note("(debug mode's pre-flight launch failed: no user code ran)")
        raise
    world = config.world_size
    print(f"accelkit: pre-flight launch OK ({world} processes formed a group and met at a barrier)", file=sys.stderr)
