"""Forming, adopting, re-forming and destroying the process group of the state (:mod:`._state`)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from . import _env
from .errors import ConfigurationError, StateError

if TYPE_CHECKING:
    from ._state import ProcessState

__all__ = ["adopt", "destroy", "form", "reform"]


def adopt(launch: _env.LaunchEnv, dist: Any) -> _env.LaunchEnv:
    """Where this process stands in a group the user created before accelkit (checked against the launcher's)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if launch.launcher == "none":
        return _env.LaunchEnv("user", rank, world, rank, world, 0, 1)
    if (launch.rank, launch.world_size) != (rank, world):
        raise StateError(
            f"the existing process group says rank {rank} of {world}, but the {launch.launcher} "
            f"variables say rank {launch.rank} of {launch.world_size}; create the group with "
            f"the launcher's RANK and WORLD_SIZE, or let accelkit create it"
        )
    return launch


def form(launch: _env.LaunchEnv, backend: str, timeout: float, launch_opts: dict[str, Any], prefix: str) -> None:
    """Join this launch's process group, its keys under ``prefix`` in the job's store."""
    import torch.distributed as dist

    addr = launch.master_addr or launch_opts.get("master_addr")
    port = launch.master_port or launch_opts.get("master_port")
    if addr is None:
        if launch.num_nodes > 1:
            raise ConfigurationError(
                f"rank {launch.rank}: {launch.launcher} started {launch.num_nodes} nodes but "
                f"MASTER_ADDR is not set; export MASTER_ADDR=<address of the rank-0 node>"
            )
        addr = "127.0.0.1"
    if port is None:
        if launch.launcher in ("openmpi", "pmi", "slurm"):
            port = 29500  # torch's conventional default; set MASTER_PORT to choose another
        else:
            raise ConfigurationError(f"rank {launch.rank}: MASTER_PORT is not set; export MASTER_PORT=<free port>")
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            str(addr),
            int(port),
            launch.world_size,
            is_master=launch.rank == 0 and not launch.agent_store,
            timeout=timedelta(seconds=timeout),
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timedelta(seconds=timeout),
        )
    except Exception as exc:
        raise StateError(
            f"rank {launch.rank} of {launch.world_size} could not join the {backend} process "
            f"group at {addr}:{port} within {timeout:g} s: {exc}. Check that every rank was "
            f"started and that MASTER_ADDR/MASTER_PORT agree across them."
        ) from exc


def reform(st: ProcessState, store: Any, prefix: str) -> None:
    """Replace this process's default group by a fresh one on ``store``, under ``prefix``.

    Every rank calls it with the same ``prefix``, new to ``store``. The current group, if
    this process still has one, is destroyed first; the new one has the state's ranks,
    backend and timeout. The caller keeps ``store`` referenced throughout: rank 0's
    TCPStore server would otherwise go away with the old group.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        dist.init_process_group(
            st.backend,
            store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
            rank=st.rank,
            world_size=st.world_size,
            timeout=timedelta(seconds=st.options.timeout),
        )
    except Exception as exc:
        raise StateError(
            f"rank {st.rank} of {st.world_size} could not re-form the {st.backend} process group "
            f"({prefix!r}) within {st.options.timeout:g} s: {exc}"
        ) from exc


def destroy() -> None:
    """Destroy the default process group, if there is one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
