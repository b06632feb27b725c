"""Building the process state, on first use or by ``ak.init``, and changing its options."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import _env, _frames
from .._backends import select_backend
from .._config import resolve
from .._options import INIT_LAUNCH_NAMES, InitOptions
from ..errors import StateError
from ._globals import current, register_process_hooks, stop_upkeep, this_process, training
from ._records import ProcessState

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .._strategies import Strategy

__all__ = ["configure", "explicit_options", "get", "init", "reform_group", "strategy"]

_CHECKED = ("num_processes", "num_nodes", "node_rank")  # init cannot choose them: it checks them


def get() -> ProcessState:
    """The current state, built on first use.

    On the step path (every prepared call asks): no ``os.getpid()`` system call here, as a forked
    child drops its parent's state at once (an at-fork hook, see :func:`_create`).
    """
    st = this_process.state
    if st is not None:
        return st
    with this_process.lock:
        return current() or _create({}, {}, f"{_frames.call_site()} (first use)")


def strategy() -> Strategy:
    """The parallelism strategy of the current state (built on first use)."""
    st = this_process.state or get()
    if st.strategy is None:  # a state built by hand (tests); every accelkit-built state has one
        raise StateError("this ProcessState has no strategy; build it with ak.init() or ak.state()")
    return st.strategy


def own_step() -> Strategy | None:
    """The strategy, where the training step must go through it; None where the step is torch's own
    (``training.torch_step``: the step path reads that flag first, and calls this only when it is unset)."""
    if training.torch_step:
        return None
    found = training.strategy or strategy()  # on first use this builds the state, which sets the flag
    return None if training.torch_step else found


def init(**options: Unpack[InitOptions]) -> ProcessState:
    """Initialise the state explicitly (optional), or set options of the state that exists.

    Options set in code apply, wherever ``ak.init`` is called (where ``Accelerator(...)`` was, even
    inside a launched function): they replace values that came from defaults, ``ACCELKIT_*``
    variables or the config file. Two different explicit values for one option (two ``ak.init``
    calls, ``@ak.distributed(precision=...)`` and ``ak.init(precision=...)``, or code and an
    ``accelkit launch`` flag) are an error naming both. The same options again are a no-op.

    Args:
        **options: the state options, each a keyword: ``precision``, ``gradient_accumulation_steps``,
            ``sync_each_batch``, ``cpu``, ``debug``, ``check_collectives``, ``backend``, ``timeout``;
            ``strategy`` with ``fsdp_*`` or ``deepspeed_config``; the mesh's ``dp_replicate``,
            ``dp_shard``, ``tp``; ``activation_checkpointing``, ``comm_hook*``, ``log_with``,
            ``project_dir``; and a launch's ``num_processes``, ``num_nodes``, ``node_rank``,
            ``master_addr``, ``master_port``. The Launching guide's table says what each does.

    Example:
        >>> import accelkit as ak
        >>> ak.init(precision="bf16").options.precision
        'bf16'
    """
    return configure(dict(options), f"accelkit.init at {_frames.call_site()}")


def configure(options: Mapping[str, Any], origin: str) -> ProcessState:
    """What :func:`init` does; ``origin`` says who set these options (for conflict messages)."""
    given = dict(options)
    launch_opts = {k: given.pop(k) for k in INIT_LAUNCH_NAMES if k in given}
    for name in ("max_restarts", "start_method"):
        if name in given:
            raise TypeError(
                f"accelkit.init({name}={given[name]!r}): init does not start processes; "
                f"pass {name} to @ak.distributed, ak.launch or `accelkit launch`"
            )
    explicit = {k: v for k, v in given.items() if v is not None}
    with this_process.lock:
        st = current()
        if st is None:
            st = _create(explicit, launch_opts, origin)
        elif explicit:
            st = _update(st, explicit, origin)
        _check_launch(st, launch_opts)
        return st


def explicit_options() -> dict[str, Any]:
    """The options of the current state that were set explicitly (code or launcher flags), by name."""
    st = current()
    if st is None:
        return {}
    return {k: getattr(st.options, k) for k, source in st.sources.items() if source in ("code", "flag")}


# Options fixed once the device is chosen and the process group formed (changing them needs a new group).
_FIXED_WITH_THE_GROUP = ("cpu", "backend", "timeout")
# Options that choose the strategy: changing them is only possible before anything was prepared.
_STRATEGY_OPTIONS = ("strategy", "fsdp_wrap", "fsdp_min_params", "fsdp_reshard_after_forward", "fsdp_cpu_offload",
                     "deepspeed_config", "dp_replicate", "dp_shard", "tp", "cp")  # fmt: skip


def _update(st: ProcessState, explicit: dict[str, Any], origin: str) -> ProcessState:
    """The state with ``explicit`` applied over what defaults, variables and the config file gave."""
    wanted = resolve(explicit, call="accelkit.init")  # validates; a launcher flag that differs is an error
    changes = {k: getattr(wanted.options, k) for k in explicit if getattr(wanted.options, k) != getattr(st.options, k)}
    if not changes and all(st.sources.get(k) in ("code", "flag") for k in explicit):
        return st  # the same options again
    set_before = [k for k in changes if st.sources.get(k) in ("code", "flag")]
    if set_before:
        lines = "; ".join(
            f"{k}={changes[k]!r} here, {getattr(st.options, k)!r} set by {st.origins.get(k, 'a launcher flag')}"
            for k in set_before
        )
        raise StateError(
            f"{origin}: {', '.join(set_before)} set twice with different values ({lines}). "
            f"Pass the same value, or set it in one place only."
        )
    fixed = [k for k in changes if k in _FIXED_WITH_THE_GROUP]
    if fixed and st.distributed:
        raise StateError(
            f"{origin}: {', '.join(f'{k}={changes[k]!r}' for k in fixed)} cannot apply any more: this process "
            f"already joined the {st.backend} process group on {st.device} when accelkit's state was created at "
            f"{this_process.origin}. Call ak.init({', '.join(f'{k}=...' for k in fixed)}) before anything else uses "
            f"accelkit, or pass it to @ak.distributed / ak.launch / `accelkit launch`."
        )
    if any(k in _STRATEGY_OPTIONS for k in changes) and (len(training.models) or len(training.optimizers)):
        raise StateError(
            f"{origin}: {', '.join(k for k in changes if k in _STRATEGY_OPTIONS)} cannot change after ak.prepare "
            f"wrapped a model for strategy={st.options.strategy!r}; call ak.init(...) before ak.prepare."
        )
    options = st.options._replace(**changes)
    hardware, device = st.hardware, st.device
    if fixed:  # one process, no group: choose the device again
        hardware = select_backend(cpu=options.cpu)
        device = hardware.device(st.local_rank)
    from .._strategies import select_strategy

    sources = {**st.sources, **dict.fromkeys(explicit, "code")}
    origins = {**st.origins, **dict.fromkeys(explicit, origin)}
    strategy = st.strategy
    if changes:  # the strategy holds the options: a new one, keeping what the old one holds (the grad scaler)
        strategy = select_strategy(options, st.world_size, device, st.local_world_size)
        if st.strategy is not None:
            strategy.keep_from(st.strategy)
    st = this_process.state = dataclasses.replace(
        st, options=options, hardware=hardware, device=device, strategy=strategy, sources=sources, origins=origins
    )
    training.use(strategy)
    return st


def _create(explicit: dict[str, Any], launch_opts: dict[str, Any], origin: str) -> ProcessState:
    resolved = resolve(explicit, call="accelkit.init")
    options = resolved.options
    launch = _env.detect_launch()
    hardware = select_backend(cpu=options.cpu)
    device = hardware.device(launch.local_rank)
    backend = options.backend or hardware.dist_backend
    owns = False
    import torch.distributed as dist

    from .._strategies import check_layout, select_strategy

    check_layout(options, launch.world_size, launch.local_world_size, device, "accelkit.init")  # before the group
    if dist.is_available() and dist.is_initialized():
        from .. import _group

        launch = _group.adopt(launch)
        backend = str(dist.get_backend())
    elif launch.world_size > 1:
        store, address = _init_group(launch, backend, options.timeout, launch_opts)
        owns = True
    st = ProcessState(
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        local_world_size=launch.local_world_size,
        node_rank=launch.node_rank,
        num_nodes=launch.num_nodes,
        device=device,
        backend=backend,
        options=options,
        launcher=launch.launcher,
        restart_count=launch.restart_count,
        pid=os.getpid(),
        hardware=hardware,
        strategy=select_strategy(options, launch.world_size, device, launch.local_world_size),
        sources=dict(resolved.sources),
        origins=dict.fromkeys(explicit, origin),
    )
    if owns:
        try:
            from .. import _group

            _group.start_upkeep(st, store, address, this_process.group)
        except BaseException:
            stop_upkeep(sys.exc_info()[1])
            _group.destroy()
            raise
    this_process.state, this_process.owns_group, this_process.origin = st, owns, origin
    training.use(st.strategy)
    register_process_hooks(st.distributed)
    return st


def _init_group(
    launch: _env.LaunchEnv, backend: str, timeout: float, launch_opts: dict[str, Any]
) -> tuple[Any, tuple[str, int]]:
    from .. import _group

    # The elastic agent's store outlives a restart, and this process may form a group again after
    # reset_state: each attempt and each group gets its own key prefix.
    prefix = f"accelkit/attempt{launch.restart_count}/group{this_process.generation}"
    store, address = _group.form(launch, backend, timeout, launch_opts, prefix)
    this_process.generation += 1
    this_process.group.prefix = prefix
    return store, address


def reform_group(store: Any, prefix: str) -> None:
    """Replace this process's default group by a fresh one on ``store``, under ``prefix``.

    Every rank calls it with the same ``prefix``, new to ``store``. The current group, if
    this process still has one, is destroyed first; the new one has the state's ranks,
    backend and timeout. The caller keeps ``store`` referenced throughout: rank 0's
    TCPStore server would otherwise go away with the old group.
    """
    from .. import _group

    with this_process.lock:
        st = get()
        this_process.group.channels = None  # every rank forgets its collectives' history alike: a new group
        _group.reform(st, store, prefix)


def _check_launch(st: ProcessState, launch_opts: dict[str, Any]) -> None:
    actual = {"num_processes": st.local_world_size, "num_nodes": st.num_nodes, "node_rank": st.node_rank}
    for name in _CHECKED:
        if launch_opts.get(name) is not None and launch_opts[name] != actual[name]:
            raise StateError(
                f"accelkit.init({name}={launch_opts[name]!r}) but this process was started with "
                f"{name}={actual[name]}; init does not start processes: use @ak.distributed, "
                f"ak.launch or `accelkit launch` to choose {name}"
            )
