"""The one process-global of accelkit: a frozen snapshot of where this process stands.

Built lazily on first use, guarded by a lock, forgotten by :func:`reset_state` or when the
process id changes (a forked child never reuses its parent's state or process group).

It is longer than 400 lines because every process-global lives here by design: the state, the
training state, the group's keys and the running experiment trackers, each reset together.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

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
    sources: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)  # option -> its layer
    origins: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)  # option -> who set it in code

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
    - ``accumulation_steps``: the steps of the innermost ``ak.accumulate`` (1 outside);
      ``accumulating``: how many ``ak.accumulate`` regions are open (0 outside).
    - ``backward_calls``: ``ak.backward`` calls so far (a region compares it at entry and exit).
    - ``warned``: the training warnings given once (again after a reset: a new run).
    - ``strategy``: the current state's strategy, kept here for the step path (an attribute read,
      where ``strategy()`` is a call); None until a state exists. Set with the state, and a new
      ``TrainingState`` comes with every new state (``reset_state``, a fork).
    - ``optimizers``: the prepared optimizers. Weak: an optimizer the user dropped no longer takes part.
    - ``loaders``: every prepared dataloader, in the order prepared (weak references, so
      a dropped loader is forgotten); ``ak.save_state`` saves their positions and
      ``ak.load_state`` restores them by that order. A list, not a ``WeakSet``: the order
      is how a resumed run matches each saved position to its loader.
    - ``models``: the models ``ak.prepare`` returned (weak), so that preparing one again is a no-op.
    - ``saving``: ``ak.save_state(blocking=False)``'s save in flight and staging buffers
      (``checkpoint/_async``); ``close()`` waits for it, before the state or group goes.
    """

    micro_step: int = 0
    sync_gradients: bool = True
    active_loaders: list[Any] = field(default_factory=list)
    accumulation_steps: int = 1
    accumulating: int = 0
    backward_calls: int = 0
    warned: set[str] = field(default_factory=set)
    strategy: Strategy | None = None
    optimizers: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    loaders: list[weakref.ReferenceType[Any]] = field(default_factory=list)
    models: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    saving: Any = None


class Now(NamedTuple):
    """Where this rank is, as the heartbeat reads it: an immutable snapshot, replaced whole.

    ``op`` / ``seq``: the current or last collective; ``inside``: waiting in it now; ``since``:
    ``time.monotonic()`` when it entered (inside) or left it; ``thread``: the thread that called it;
    ``fingerprint`` and ``text``: the call, while inside (what two ranks in the same call share, and
    the call as the tables show it); ``doing``: a step that waits for the other ranks outside the
    collectives (a backward pass that synchronises gradients), or "".
    """

    op: str
    seq: int
    inside: bool
    since: float
    thread: int
    fingerprint: int
    text: str
    doing: str = ""


NOWHERE = Now("", 0, False, 0.0, 0, 0, "")


class doing:
    """``with _state.doing("..."):`` marks this rank's snapshot (``group.now``) for the heartbeat."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        group.now = group.now._replace(doing=self.what)

    def __exit__(self, *exc: object) -> None:
        group.now = group.now._replace(doing="")


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
    # Collectives (see collectives/_checked.py). Every rank updates these alike, from what all ranks sent.
    seq: int = 0  # accelkit collectives begun on this group: the number of the current or last one
    key: int = 0  # the point of the program: the fingerprint of the last call every rank agreed on (0: none)
    plans: dict[int, Any] = field(default_factory=dict)  # what every rank sends at a point (collectives/_plan)
    direct: Any = None  # the default group's backend and its options, called directly (collectives/_exchange)
    pending: Any = None  # the last call's verdict, on its way from an accelerator (collectives/_check.Deferred)
    checkpoint_group: Any = None  # the gloo group background saves agree over (checkpoint/_async), made on first use
    meetings: dict[str, int] = field(default_factory=dict)  # _group.meet's count of each step's meetings
    closed: str = ""  # why this rank closed the group (ranks out of step after a broadcast), or ""
    # Where this rank is: replaced whole by the collectives, read by the heartbeat thread.
    now: Now = field(default_factory=lambda: NOWHERE)
    store: Any = None  # a client of the job's store with a short timeout: the heartbeat's, and reports
    board: str = ""  # the key prefix of positions and reports in that store (see _group)
    heartbeat: Any = None  # the heartbeat thread (see _group)

    def restart_collectives(self) -> None:
        """Every rank forgets its collectives' history alike (a group re-formed after a failure)."""
        self.seq, self.key, self.plans, self.pending, self.direct = 0, 0, {}, None, None


@dataclass
class TrackingState:
    """The experiment trackers of this process (``ak.init_trackers``); ended with the process state.

    - ``started``: ``ak.init_trackers`` was called (on any rank); ``is_main``: this process writes.
    - ``trackers``: name -> running tracker, on the main process only. Each has ``log(values, step)``,
      ``finish(failed)`` and ``writer``; :func:`end_trackers` finishes them.
    - ``directory``: the run's folder (``project_dir/project_name``); ``step``: the last step logged.
    - ``pid``: the process that started them; a forked child never writes to its parent's files.
    """

    started: bool = False
    is_main: bool = False
    trackers: dict[str, Any] = field(default_factory=dict)
    directory: str = ""
    step: int = -1
    pid: int = field(default_factory=os.getpid)


_lock = threading.RLock()
_state: ProcessState | None = None
training = TrainingState()
group = GroupState()
tracking = TrackingState()
_generation = 0  # groups formed by this process (outlives reset_state: the next one gets a new prefix)
_origin = ""  # where the state was created, for error messages
_owns_group = False  # whether accelkit created the process group (and so destroys it)
_exit_hook_registered = False
_fork_hook_registered = False
step_watch: Any = None  # the optimizer-step hook that warns of unprepared optimizers under ak.accumulate
_tracker_hook_registered = False
breakpoint_requested = False  # set by ak.set_breakpoint, read by ak.check_breakpoint
warned: set[str] = set()  # warnings given once per process (they outlive reset_state)

_CHECKED = ("num_processes", "num_nodes", "node_rank")  # init cannot choose them: it checks them


def get() -> ProcessState:
    """The current state, built on first use.

    On the step path (every prepared call asks): no ``os.getpid()`` system call here, as a forked
    child drops its parent's state at once (an at-fork hook, see :func:`_create`).
    """
    st = _state
    if st is not None:
        return st
    with _lock:
        return _current() or _create({}, {}, f"{_frames.call_site()} (first use)")


def strategy() -> Strategy:
    """The parallelism strategy of the current state (built on first use)."""
    st = _state if _state is not None else get()
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
    """Initialise the state explicitly (optional), or set options of the state that exists.

    Options set in code apply, wherever ``ak.init`` is called (where ``Accelerator(...)`` was, even
    inside a launched function): they replace values that came from defaults, ``ACCELKIT_*``
    variables or the config file. Two different explicit values for one option (two ``ak.init``
    calls, ``@ak.distributed(precision=...)`` and ``ak.init(precision=...)``, or code and an
    ``accelkit launch`` flag) are an error naming both. The same options again are a no-op.

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
    with _lock:
        st = _current()
        if st is None:
            st = _create(explicit, launch_opts, origin)
        elif explicit:
            st = _update(st, explicit, origin)
        _check_launch(st, launch_opts)
        return st


def explicit_options() -> dict[str, Any]:
    """The options of the current state that were set explicitly (code or launcher flags), by name."""
    st = _current()
    if st is None:
        return {}
    return {k: getattr(st.options, k) for k, source in st.sources.items() if source in ("code", "flag")}


# Options fixed once the device is chosen and the process group formed (changing them needs a new group).
_FIXED_WITH_THE_GROUP = ("cpu", "backend", "timeout")
# Options that choose the strategy: changing them is only possible before anything was prepared.
_STRATEGY_OPTIONS = ("strategy", "fsdp_wrap", "fsdp_min_params", "fsdp_reshard_after_forward", "fsdp_cpu_offload",
                     "deepspeed_config")  # fmt: skip


def _update(st: ProcessState, explicit: dict[str, Any], origin: str) -> ProcessState:
    """The state with ``explicit`` applied over what defaults, variables and the config file gave."""
    global _state
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
            f"{_origin}. Call ak.init({', '.join(f'{k}=...' for k in fixed)}) before anything else uses accelkit, "
            f"or pass it to @ak.distributed / ak.launch / `accelkit launch`."
        )
    if any(k in _STRATEGY_OPTIONS for k in changes) and (len(training.models) or len(training.optimizers)):
        raise StateError(
            f"{origin}: {', '.join(k for k in changes if k in _STRATEGY_OPTIONS)} cannot change after ak.prepare "
            f"wrapped a model for strategy={st.options.strategy!r}; call ak.init(...) before ak.prepare."
        )
    options = replace(st.options, **changes)
    hardware, device = st.hardware, st.device
    if fixed:  # one process, no group: choose the device again
        hardware = select_backend(cpu=options.cpu)
        device = hardware.device(st.local_rank)
    from ._strategies import select_strategy

    sources = {**st.sources, **dict.fromkeys(explicit, "code")}
    origins = {**st.origins, **dict.fromkeys(explicit, origin)}
    strategy = st.strategy
    if changes:  # the strategy holds the options: a new one, keeping what the old one holds (the grad scaler)
        strategy = select_strategy(options, st.world_size, device)
        if st.strategy is not None:
            strategy.keep_from(st.strategy)
    _state = replace(
        st, options=options, hardware=hardware, device=device, strategy=strategy, sources=sources, origins=origins
    )
    training.strategy = strategy
    return _state


def reset_state() -> None:
    """Destroy the process group accelkit created and forget the state.

    Running experiment trackers are flushed and closed first. A group the user created before
    accelkit adopted it is left to the user.
    """
    global _state, _owns_group, breakpoint_requested, training, group
    _close_saving()
    with _lock:
        end_trackers(failed=False)
        if _current() is not None:
            _stop_upkeep()
            if _owns_group:
                _destroy_group()
        _state, _owns_group, breakpoint_requested = None, False, False
        training, group = TrainingState(), GroupState()


def new_task() -> None:
    """Start a task afresh in a process whose group lives on (``accelkit.testing``'s workers):
    forget the training objects and the options set in code; keep the group and the device."""
    global training, _state
    _close_saving()
    with _lock:
        end_trackers(failed=False)
        training = TrainingState()
        st = _current()
        if st is not None and st.origins:
            from ._strategies import select_strategy

            resolved = resolve(call="accelkit.testing")
            _state = replace(
                st,
                options=resolved.options,
                sources=dict(resolved.sources),
                origins={},
                strategy=select_strategy(resolved.options, st.world_size, st.device),
            )
        if _state is not None:
            training.strategy = _state.strategy


def _close_saving() -> None:
    """Let a save in flight (``ak.save_state(blocking=False)``) commit or fail before its state and group go."""
    saving, training.saving = training.saving, None
    if saving is not None:
        saving.close()


def start_tracking(is_main: bool, trackers: dict[str, Any], directory: str) -> TrackingState:
    """Record the trackers ``ak.init_trackers`` started (after ending any still running)."""
    global tracking, _tracker_hook_registered
    with _lock:
        end_trackers(failed=False)
        tracking = TrackingState(started=True, is_main=is_main, trackers=dict(trackers), directory=directory)
        if trackers and not _tracker_hook_registered:
            # Trackers write from buffers and threads of their own: end them before the interpreter goes.
            atexit.register(_end_trackers_at_exit)
            _tracker_hook_registered = True
        return tracking


def current_tracking() -> TrackingState:
    """This process's trackers (a forked child starts with none: its parent's files are not its own)."""
    global tracking
    if tracking.pid != os.getpid():
        tracking = TrackingState()
    return tracking


def end_trackers(failed: bool) -> list[tuple[str, BaseException]]:
    """Flush and close every running tracker, each even when another fails; what failed, by name.

    ``failed`` tells the trackers that keep a run status (W&B, MLflow) that the job failed.
    """
    global tracking
    with _lock:
        running = current_tracking().trackers
        tracking = TrackingState()
    errors: list[tuple[str, BaseException]] = []
    for name, tracker in running.items():
        try:
            tracker.finish(failed)
        except Exception as exc:  # one tracker's failure must not keep the others' data from the disk
            errors.append((name, exc))
    return errors


def _end_trackers_at_exit() -> None:
    import sys

    # Python keeps an uncaught exception in sys.last_value before the atexit hooks run.
    errors = end_trackers(failed=getattr(sys, "last_value", None) is not None)
    for name, exc in errors:
        print(f"accelkit: could not close the {name} tracker at exit: {exc!r}", file=sys.stderr)


def peek() -> ProcessState | None:
    """The current state, or None when there is none yet (nothing is created by asking)."""
    st = _state
    return st if st is not None and st.pid == os.getpid() else None


def _current() -> ProcessState | None:
    global _state, _owns_group, training, group, _generation
    if _state is not None and _state.pid != os.getpid():
        # Forked child: the parent's group and device are not ours to use or destroy.
        _state, _owns_group, _generation = None, False, 0
        training, group = TrainingState(), GroupState()
        current_tracking()  # the parent's trackers are forgotten, not closed
    return _state


def _create(explicit: dict[str, Any], launch_opts: dict[str, Any], origin: str) -> ProcessState:
    global _state, _origin, _owns_group, _generation
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
        origins=dict.fromkeys(explicit, origin),
    )
    if owns:
        try:
            from . import _group

            _group.start_upkeep(st, store, address, group)
        except BaseException:
            _stop_upkeep()
            _destroy_group()
            raise
    _state, _owns_group, _origin = st, owns, origin
    training.strategy = st.strategy
    _register_fork_hook()
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


def _register_fork_hook() -> None:
    global _fork_hook_registered
    if not _fork_hook_registered:
        # A forked child never reuses its parent's state (nor its group): it forgets it at once.
        os.register_at_fork(after_in_child=_current)
        _fork_hook_registered = True


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
    _group.destroy_before_exit(st.strategy if st is not None else None, models)
