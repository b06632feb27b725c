"""The one process-global object of accelkit (``this_process``), and the three ways it is forgotten:
``reset_state``, a new task in a process whose group lives on, and a forked child.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

from .._config import resolve
from ._records import GroupState, ProcessState, TrainingState

__all__ = [
    "ProcessGlobals",
    "close_group",
    "close_saving",
    "current",
    "group",
    "hooks",
    "is_initialized",
    "new_task",
    "origin",
    "peek",
    "register_process_hooks",
    "reset_state",
    "stop_upkeep",
    "this_process",
    "training",
]


class ProcessGlobals:
    """Every process-global of accelkit, in one object, forgotten by one :meth:`reset`.

    - ``state``: the :class:`ProcessState`, None until built; ``origin``: where it was built (for messages).
    - ``training`` and ``group``: the records of training and of the process group. Reset in place,
      so that ``_state.training`` and ``_state.group`` (read on the step path) are always these.
    - ``owns_group``: accelkit formed the process group (and so destroys it).
    - ``tracking``: the running experiment trackers (``accelkit._tracking``'s record), None when none.
    - ``breakpoint_requested``: set by ``ak.set_breakpoint``, taken by ``ak.check_breakpoint``.

    Kept by every reset: ``generation`` (groups this process formed: each gets its own key prefix;
    a forked child counts from 0, as its siblings do), ``warned`` (warnings given once per process),
    ``hooks`` (what is registered once per process, by name) and ``lock`` (guards building and
    forgetting the state).
    """

    __slots__ = ("breakpoint_requested", "generation", "group", "hooks", "lock", "origin", "owns_group", "state",
                 "tracking", "training", "warned")  # fmt: skip

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.state: ProcessState | None = None
        self.origin = ""
        self.training = TrainingState()
        self.group = GroupState()
        self.owns_group = False
        self.tracking: Any = None
        self.breakpoint_requested = False
        self.generation = 0
        self.warned: set[str] = set()
        self.hooks: dict[str, Any] = {}

    def reset(self, *, keep_group: bool = False, forked: bool = False) -> None:
        """Forget a run: the training record, the trackers (ended first) and a requested breakpoint;
        unless ``keep_group``, also the state, the group's record and the group (destroyed first
        if accelkit formed it). ``forked``: a forked child, to which its parent's trackers and
        group are not its own to end; its groups count from 0.

        The caller holds ``lock`` (but in a forked child: a thread of the parent may have held it)
        and has waited for a save in flight first (:func:`close_saving`, outside the lock).
        """
        if forked:
            self.tracking = None
        else:
            self.end_tracking(failed=False)  # what failed, ak.end_training reports
            if not keep_group and self.state is not None and self.state.pid == os.getpid():
                stop_upkeep(sys.exc_info()[1])  # a failure on its way out of the code that resets
                if self.owns_group:
                    _destroy_group()
        _renew(self.training)
        self.breakpoint_requested = False
        if not keep_group:
            self.state, self.owns_group = None, False
            _renew(self.group)
        if forked:
            self.generation = 0

    def once(self, name: str, register: Callable[[], Any]) -> None:
        """Call ``register`` (it registers a hook) the first time ``name`` is asked for in this process."""
        if name not in self.hooks:
            self.hooks[name] = register()

    def swap_tracking(self, tracking: Any) -> Any:
        """Hold ``tracking`` as this process's running trackers; the record held until now (or None)."""
        with self.lock:
            before, self.tracking = self.tracking, tracking
        return before

    def end_tracking(self, failed: bool) -> list[tuple[str, BaseException]]:
        """Flush, close and forget the running trackers (``failed``: the run failed); what failed, by name.

        Those of a parent process are forgotten, not ended: a forked child never writes to their files.
        """
        running = self.swap_tracking(None)
        if running is None or running.pid != os.getpid():
            return []
        return running.end(failed)  # type: ignore[no-any-return]

    def request_breakpoint(self) -> None:
        self.breakpoint_requested = True

    def take_breakpoint(self) -> bool:
        """Whether a breakpoint was requested since the last time it was taken."""
        requested, self.breakpoint_requested = self.breakpoint_requested, False
        return requested


def _renew(record: Any) -> None:
    """Every attribute of a ``__slots__`` record (``TrainingState``, ``GroupState``) back to its default, in place."""
    fresh = type(record)()
    for name in type(record).__slots__:
        setattr(record, name, getattr(fresh, name))


this_process = ProcessGlobals()
training = this_process.training  # these three are the same objects for the life of the process
group = this_process.group
hooks = this_process.hooks


def peek() -> ProcessState | None:
    """The current state, or None when there is none yet (nothing is created by asking)."""
    st = this_process.state
    return st if st is not None and st.pid == os.getpid() else None


def origin() -> str:
    """Where the current state was created (``file:line in function (how)``), for messages."""
    return this_process.origin


def current() -> ProcessState | None:
    """The current state, or None; a forked child forgets its parent's here (also at the fork)."""
    st = this_process.state
    if st is not None and st.pid != os.getpid():
        this_process.reset(forked=True)  # the parent's group and device are not ours to use or destroy
        return None
    return st


def is_initialized() -> bool:
    """Whether the state exists in this process (nothing is created by asking)."""
    with this_process.lock:
        return current() is not None


def reset_state() -> None:
    """Destroy the process group accelkit created and forget the state.

    Running experiment trackers are flushed and closed first. A group the user created before
    accelkit adopted it is left to the user.
    """
    close_saving()
    with this_process.lock:
        current()
        this_process.reset()


def new_task() -> None:
    """Start a task afresh in a process whose group lives on (``accelkit.testing``'s workers):
    forget the training objects and the options set in code; keep the group and the device."""
    close_saving()
    with this_process.lock:
        this_process.reset(keep_group=True)
        st = current()
        if st is not None and st.origins:
            from .._strategies import select_strategy

            resolved = resolve(call="accelkit.testing")
            st = this_process.state = dataclasses.replace(
                st,
                options=resolved.options,
                sources=dict(resolved.sources),
                origins={},
                strategy=select_strategy(resolved.options, st.world_size, st.device, st.local_world_size),
            )
        if st is not None:
            training.use(st.strategy)


def close_saving() -> None:
    """Let a save in flight (``ak.save_state(blocking=False)``) commit or fail before its state and group go."""
    saving, training.saving = training.saving, None
    if saving is not None:
        saving.close()


def stop_upkeep(failure: BaseException | None = None) -> None:
    """Stop the heartbeat; its last position says that this rank left the group, and how: ``failure`` (raised
    at the user's line), or its code returned."""
    if group.heartbeat is not None:
        group.heartbeat.stop(*_farewell(failure))
    group.heartbeat = group.store = None


def _farewell(failure: BaseException | None) -> tuple[str, str]:
    if failure is None or (isinstance(failure, SystemExit) and failure.code in (None, 0)):
        return "its code returned", ""
    from .. import _rundir

    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(failure.__traceback__)]
    spot = _rundir.spot_of(frames)
    message = str(failure).strip().splitlines()
    said = f"it raised {type(failure).__name__}" + (f": {message[0][:200]}" if message else "")
    return said, spot.line if spot is not None else ""


def close_group(reason: str) -> None:
    """Refuse every later collective with ``reason``, and destroy the group if accelkit formed it.

    For a rank that found the ranks out of step where no other rank can tell (a broadcast is
    one-way): the others' current or next collective then fails at once instead of waiting.
    """
    with this_process.lock:
        group.closed = reason
        if this_process.owns_group:
            _destroy_group()


def _destroy_group() -> None:
    from .. import _group

    st = this_process.state
    _group.destroy_and_release(st.strategy if st is not None else None, list(training.models))


def register_process_hooks(distributed: bool) -> None:
    """Once per process: forget the state in a forked child at once; with a group, end it before exit."""
    # A forked child never reuses its parent's state (nor its group): it forgets it at once.
    this_process.once("fork", lambda: os.register_at_fork(after_in_child=current))
    if distributed:
        this_process.once("exit", lambda: atexit.register(_at_exit))


def _at_exit() -> None:
    # A gloo group alive at interpreter exit can abort the process after a run that succeeded:
    # see _group.destroy_and_release. Also a group the user created: nothing can use it after exit.
    from .. import _group

    st = current()
    models = list(training.models) if st is not None else []
    stop_upkeep(getattr(sys, "last_value", None))  # an exception that ended the script, if one did
    reset_state()
    _group.destroy_and_release(st.strategy if st is not None else None, models)
