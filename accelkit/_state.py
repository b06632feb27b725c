"""The one process-global of accelkit: a frozen snapshot of where this process stands.

Built lazily on first use, guarded by a lock, forgotten by :func:`reset_state` or when the
process id changes (a forked child never reuses its parent's state or process group).
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from . import _env, _frames
from ._backends import Backend, select_backend
from ._options import INIT_LAUNCH_NAMES, InitOptions, Options
from .config import resolve
from .errors import StateError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._strategies import Strategy

__all__ = ["ProcessState", "get", "init", "is_initialized", "reset_state"]


@dataclass(frozen=True)
class ProcessState:
    """Where this process stands in the job. Read it with ``ak.state()``.

    Example:
        >>> import accelkit as ak
        >>> ak.state().world_size
        1
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: torch.device
    backend: str
    options: Options
    launcher: str = "none"
    restart_count: int = 0  # how many times the elastic agent restarted the job so far
    pid: int = field(default_factory=os.getpid, repr=False, compare=False)
    hardware: Backend | None = field(default=None, repr=False, compare=False)
    strategy: Strategy | None = field(default=None, repr=False, compare=False)  # chosen once, from the options
    sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)  # option -> where it came from

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0


@dataclass
class TrainingState:
    """The mutable side of training in this process; reset with the process state.

    - ``micro_step``: micro-steps seen inside ``ak.accumulate`` since the last reset.
    - ``sync_gradients``: whether the current step synchronises gradients and really
      steps the optimizer (False on accumulation micro-steps).
    - ``active_loaders``: prepared dataloaders being iterated, innermost last; each entry
      knows whether it is on its last batch and how many samples it padded there.
    - ``accumulation_steps``: the steps of the innermost ``ak.accumulate`` (1 outside).
    - ``scaler``: the fp16 ``GradScaler``, created when an optimizer is prepared under fp16.
    - ``optimizers``: the prepared optimizers; ``unscaled``: whether their gradients were
      already unscaled this step (``clip_grad_norm_`` unscales once per step). Weak: an
      optimizer the user dropped no longer takes part.
    - ``loaders``: every prepared dataloader, in the order prepared (weak references, so
      a dropped loader is forgotten); ``ak.save_state`` saves their positions and
      ``ak.load_state`` restores them by that order. A list, not a ``WeakSet``: the order
      is how a resumed run matches each saved position to its loader.
    - ``models``: the models ``ak.prepare`` returned (weak), so that preparing one again is a no-op.
    """

    micro_step: int = 0
    sync_gradients: bool = True
    active_loaders: list[Any] = field(default_factory=list)
    accumulation_steps: int = 1
    scaler: Any = None
    optimizers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    unscaled: bool = False
    loaders: list[weakref.ReferenceType[Any]] = field(default_factory=list)
    models: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


@dataclass
class GroupState:
    """What belongs to the process group accelkit formed, and goes with it.

    - ``prefix``: the group's key prefix in the job's store. Each attempt of an elastic job and
      each group this process forms (again after ``reset_state``) gets its own, so a new group
      never reads the keys of the one before.
    - ``agreements``: ``find_executable_batch_size``'s agreements so far (their store keys),
      and ``previous_agreement`` the key prefix of the last one, deleted after the next.
    """

    prefix: str = "accelkit"
    agreements: int = 0
    previous_agreement: str = ""
    # Collectives (see collectives/_wire.py). Every rank updates these alike, from what all ranks sent.
    seq: int = 0  # accelkit collectives begun on this group: the number of the current or last one
    chain: int = 0  # a running digest of the headers of every collective so far
    slot_sizes: dict[int, int] = field(default_factory=dict)  # learned first-message sizes, by the previous call
    plans: dict[int, Any] = field(default_factory=dict)  # learned all-reduces (collectives/_plan), likewise
    last_key: int = 0  # the previous two-way collective's key into slot_sizes
    buffers: dict[str, Any] = field(default_factory=dict)  # reusable slot buffers, by role (see collectives/_wire)
    closed: str = ""  # why this rank closed the group (ranks out of step after a broadcast), or ""
    alarm: str = ""  # set by the heartbeat: the ranks wait in different calls (a table); the wait gives up
    abandoned: bool = False  # a backend call was left waiting: destroying the group would wait for it (see _at_exit)
    # Where this rank is, read by the heartbeat thread; the collectives only write these.
    op: str = ""  # the current or last collective
    entered: float = 0.0  # time.monotonic() when the current collective began; 0.0 between collectives
    finished: float = 0.0  # time.monotonic() when the last one ended
    thread: int = 0  # the thread that called it
    call: Any = None  # the current collective (its signature() and describe()), for the heartbeat
    store: Any = None  # a client of the job's store with a short timeout: the heartbeat's, and reports
    board: str = ""  # the key prefix of positions and reports in that store (see _group)
    heartbeat: Any = None  # the heartbeat thread (see _group)

    def restart_collectives(self) -> None:
        """Every rank forgets its collectives' history alike (a group re-formed after a failure)."""
        self.seq, self.chain, self.last_key, self.slot_sizes, self.plans, self.buffers = 0, 0, 0, {}, {}, {}


_lock = threading.RLock()
_state: ProcessState | None = None
training = TrainingState()
group = GroupState()
_generation = 0  # groups formed by this process (outlives reset_state: the next one gets a new prefix)
_origin = ""  # where the state was created, for error messages
_owns_group = False  # whether accelkit created the process group (and so destroys it)
_exit_hook_registered = False
breakpoint_requested = False  # set by ak.set_breakpoint, read by ak.check_breakpoint
warned: set[str] = set()  # warnings given once per process (they outlive reset_state)
_abandoned = False  # a group of this process was left with a backend call waiting: it is never destroyed

_CHECKED = ("num_processes", "num_nodes", "node_rank")  # init cannot choose them: it checks them


def get() -> ProcessState:
    """The current state, built on first use."""
    st = _state
    if st is not None and st.pid == os.getpid():
        return st
    with _lock:
        return _current() or _create({}, {}, "first use")


def strategy() -> Strategy:
    """The parallelism strategy of the current state (built on first use)."""
    st = get()
    if st.strategy is None:  # a state built by hand (tests); every accelkit-built state has one
        raise StateError("this ProcessState has no strategy; build it with ak.init() or ak.state()")
    return st.strategy


def is_initialized() -> bool:
    """Whether the state exists in this process (nothing is created by asking)."""
    with _lock:
        return _current() is not None


def origin() -> str:
    """Where the current state was created (``file:line in function (how)``), for messages."""
    return _origin


def init(**options: Unpack[InitOptions]) -> ProcessState:
    """Initialise the state explicitly (optional); the same options again are a no-op.

    Example:
        >>> import accelkit as ak
        >>> ak.init(precision="bf16").options.precision
        'bf16'
    """
    given: dict[str, Any] = dict(options)
    launch_opts = {k: given.pop(k) for k in INIT_LAUNCH_NAMES if k in given}
    for name in ("max_restarts", "start_method"):
        if name in given:
            raise TypeError(
                f"accelkit.init({name}={given[name]!r}): init does not start processes; "
                f"pass {name} to @ak.distributed, ak.launch or `accelkit launch`"
            )
    explicit = {k: v for k, v in given.items() if v is not None}
    with _lock:
        st = _current()
        if st is None:
            st = _create(explicit, launch_opts, "accelkit.init")
        else:
            wanted = resolve(explicit, call="accelkit.init").options
            conflicts = {k: v for k, v in explicit.items() if getattr(wanted, k) != getattr(st.options, k)}
            if conflicts:
                asked = ", ".join(f"{k}={v!r}" for k, v in conflicts.items())
                have = ", ".join(f"{k}={getattr(st.options, k)!r}" for k in conflicts)
                raise StateError(
                    f"accelkit.init({asked}) conflicts with the state created at {_origin} with "
                    f"{have}. Pass the same options, or call ak.reset_state() first to start over."
                )
        _check_launch(st, launch_opts)
        return st


def reset_state() -> None:
    """Destroy the process group accelkit created and forget the state.

    A group the user created before accelkit adopted it is left to the user.
    """
    global _state, _owns_group, breakpoint_requested, training, group
    global _abandoned
    with _lock:
        if _current() is not None:
            _stop_upkeep()
            _abandoned = _abandoned or group.abandoned
            if _owns_group and not group.abandoned:
                _destroy_group()
        _state, _owns_group, breakpoint_requested = None, False, False
        training, group = TrainingState(), GroupState()


def new_training() -> None:
    """Forget the training objects (prepared optimizers, loaders, scaler); keep the process group."""
    global training
    training = TrainingState()


def _current() -> ProcessState | None:
    global _state, _owns_group, training, group, _generation
    if _state is not None and _state.pid != os.getpid():
        # Forked child: the parent's group and device are not ours to use or destroy.
        _state, _owns_group, _generation = None, False, 0
        training, group = TrainingState(), GroupState()
    return _state


def _create(explicit: dict[str, Any], launch_opts: dict[str, Any], reason: str) -> ProcessState:
    global _state, _origin, _owns_group
    resolved = resolve(explicit, call="accelkit.init")
    options = resolved.options
    launch = _env.detect_launch()
    hardware = select_backend(cpu=options.cpu)
    device = hardware.device(launch.local_rank)
    backend = options.backend or hardware.dist_backend
    owns = False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from . import _group

        launch = _group.adopt(launch)
        backend = str(dist.get_backend())
    elif launch.world_size > 1:
        store, address = _init_group(launch, backend, options.timeout, launch_opts)
        owns = True
    from ._strategies import select_strategy

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
        hardware=hardware,
        strategy=select_strategy(options, launch.world_size, device),
        sources=dict(resolved.sources),
    )
    if owns:
        try:
            from . import _group

            _group.start_upkeep(st, store, address, group)
        except BaseException:
            _stop_upkeep()
            _destroy_group()
            raise
    _state, _owns_group, _origin = st, owns, f"{_frames.call_site()} ({reason})"
    if st.distributed:
        _register_exit_hook()
    return st


def _stop_upkeep() -> None:
    if group.heartbeat is not None:
        group.heartbeat.stop()
    group.heartbeat = group.store = None


def close_group(reason: str) -> None:
    """Refuse every later collective with ``reason``, and destroy the group if accelkit formed it.

    For a rank that found the ranks out of step where no other rank can tell (a broadcast is
    one-way): the others' current or next collective then fails at once instead of waiting.
    """
    with _lock:
        group.closed = reason
        if _owns_group:
            _destroy_group()


def _init_group(
    launch: _env.LaunchEnv, backend: str, timeout: float, launch_opts: dict[str, Any]
) -> tuple[Any, tuple[str, int]]:
    global _generation
    from . import _group

    # The elastic agent's store outlives a restart, and this process may form a group again after
    # reset_state: each attempt and each group gets its own key prefix.
    prefix = f"accelkit/attempt{launch.restart_count}/group{_generation}"
    store, address = _group.form(launch, backend, timeout, launch_opts, prefix)
    _generation += 1
    group.prefix = prefix
    return store, address


def reform_group(store: Any, prefix: str) -> None:
    """Replace this process's default group by a fresh one on ``store``, under ``prefix``.

    Every rank calls it with the same ``prefix``, new to ``store``. The current group, if
    this process still has one, is destroyed first; the new one has the state's ranks,
    backend and timeout. The caller keeps ``store`` referenced throughout: rank 0's
    TCPStore server would otherwise go away with the old group.
    """
    from . import _group

    with _lock:
        st = get()
        group.restart_collectives()
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


def _destroy_group() -> None:
    from . import _group

    _group.destroy()


def _register_exit_hook() -> None:
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_at_exit)
        _exit_hook_registered = True


def _at_exit() -> None:
    # A gloo group alive at interpreter exit can abort the process after a run that succeeded:
    # see _group.destroy_before_exit. Also a group the user created: nothing can use it after exit.
    from . import _group

    st = _current()
    models = list(training.models) if st is not None else []
    reset_state()
    if not _abandoned:  # else it would wait for the abandoned call until the timeout; the exit ends it
        _group.destroy_before_exit(st.strategy if st is not None else None, models)
