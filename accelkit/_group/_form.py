"""Forming a group: its store and process group, then the handshake and this rank's heartbeat."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from .. import _env
from ..errors import ConfigurationError, StateError
from ._board import LATEST_BOARD
from ._handshake import handshake, job_facts
from ._heartbeat import Heartbeat, wait_log_interval

__all__ = ["adopt", "destroy", "destroy_and_release", "form", "reform", "start_upkeep"]


def form(
    launch: _env.LaunchEnv, backend: str, timeout: float, launch_opts: dict[str, Any], prefix: str
) -> tuple[Any, tuple[str, int]]:
    """Join (rank 0: host) the job's store and form the default process group on it, under ``prefix``.

    Returns the store and its address. Raises :class:`ConfigurationError` when the launcher left
    the address out, :class:`StateError` when the group does not form within ``timeout`` seconds.
    """

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
        store = _store(str(addr), int(port), launch.world_size, launch.rank == 0 and not launch.agent_store, timeout)
        _init(backend, store, prefix, launch.rank, launch.world_size, timeout)
    except Exception as exc:
        raise StateError(
            f"rank {launch.rank} of {launch.world_size} could not join the {backend} process "
            f"group at {addr}:{port} within {timeout:g} s: {exc}. Check that every rank was "
            f"started and that MASTER_ADDR/MASTER_PORT agree across them."
        ) from exc
    return store, (str(addr), int(port))


_REBIND_S = 5.0  # how long the main process tries again to listen on a port that is still being released


def _store(addr: str, port: int, world_size: int, is_master: bool, timeout: float) -> Any:
    """The job's TCPStore; the main process tries again for a few seconds while the port is in use.

    After ``ak.reset_state()`` the same process forms its group again on the same port, and the last
    store's listening socket may not be closed yet (torch's store closes it on a thread of its own).
    """
    import torch.distributed as dist

    deadline = time.monotonic() + _REBIND_S
    while True:
        try:
            return dist.TCPStore(  # type: ignore[attr-defined]
                addr, port, world_size, is_master=is_master, timeout=timedelta(seconds=timeout)
            )
        except Exception as exc:
            if not (is_master and "EADDRINUSE" in str(exc) and time.monotonic() < deadline):
                raise
            time.sleep(0.1)


def reform(st: Any, store: Any, prefix: str) -> None:
    """Destroy this process's default group, if any, and form a new one like it on ``store``, under ``prefix``."""
    destroy()
    try:
        _init(st.backend, store, prefix, st.rank, st.world_size, st.options.timeout)
    except Exception as exc:
        raise StateError(
            f"rank {st.rank} of {st.world_size} could not re-form the {st.backend} process group "
            f"({prefix!r}) within {st.options.timeout:g} s: {exc}"
        ) from exc


def _init(backend: str, store: Any, prefix: str, rank: int, world_size: int, timeout: float) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined]
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def adopt(launch: _env.LaunchEnv) -> _env.LaunchEnv:
    """Where this process stands in a process group the user formed (checked against the launcher's variables)."""
    import torch.distributed as dist

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


def start_upkeep(st: Any, store: Any, address: tuple[str, int], group: Any) -> None:
    """The handshake (every rank the same software and options), then this rank's heartbeat.

    ``st`` is the new ``ProcessState``; ``group`` its ``GroupState``, which gets ``store`` (the job's), the
    heartbeat's store client, the key prefix of the board and the heartbeat thread.
    """
    import torch.distributed as dist

    facts = job_facts(st.options, st.world_size)
    handshake(dist.PrefixStore(f"{group.prefix}/handshake", store), st.rank, st.world_size, facts)  # type: ignore[attr-defined]
    # The heartbeat's own connection, with a short timeout: a store gone away must not hold it for minutes.
    client = dist.TCPStore(address[0], address[1], None, False, timedelta(seconds=5), wait_for_workers=False)  # type: ignore[attr-defined]
    group.store, group.board, group.job_store = client, f"{group.prefix}/board", store
    if st.rank == 0:
        client.set(LATEST_BOARD, group.board)
    group.heartbeat = Heartbeat(
        client, group.board, st.rank, st.world_size, group, wait_log_interval(), st.options.timeout
    )
    group.heartbeat.start()


def destroy() -> Any:
    """Destroy every process group (the default one and those made from it); the default one, or None."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.group.WORLD
    from .. import _torch_private

    _torch_private.unpin_from_defaults(default)  # torch.distributed.nn.functional's defaults would keep it alive
    dist.destroy_process_group()
    time.sleep(_SETTLE_S)  # the GIL free for the backend's worker threads to finish with their last calls
    return default


# A gloo worker thread drops a finished call's tensors after the caller's wait returned, and from torch's
# PyObject preservation on (a tensor a C++ object also holds keeps its Python object alive: 2.10 and later)
# dropping any tensor that has a Python object takes the GIL. The group's destructor joins those threads
# holding the GIL: were one of them still dropping its last call's tensors (descheduled on a busy machine),
# both would wait for ever. The group is destroyed here, after the threads had the GIL free this long.
_SETTLE_S = 0.02


def destroy_and_release(strategy: Any, models: list[Any]) -> None:
    """Every group destroyed, the models ``strategy`` prepared let go of it, and collected: when accelkit
    ends its group (``ak.end_training``, ``ak.reset_state``), and at interpreter exit, before Python tears
    itself down. The group's destructor runs here, after :func:`destroy` let the backend's threads settle,
    not when the script later drops a DDP model.

    A gloo group that outlives the atexit hooks is torn down during the interpreter's finalization:
    its worker threads exit then, and one that takes the GIL on its way out is killed by Python,
    unwinding through C++ that cannot be unwound: std::terminate, SIGABRT ("terminate called without
    an active exception"), now and then, after a run that succeeded. destroy_process_group() alone
    does not end the threads while a DDP model (often a script's global) holds the group: the models
    ``strategy`` prepared let go of it, and the group is collected here, while Python is whole.
    """
    import gc

    if destroy() is not None or models:
        for model in models:
            if strategy is not None:
                strategy.release(model)
        gc.collect()
