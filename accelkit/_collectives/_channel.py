"""Channels: one per process group that checked collectives run over, the world's one of them.

A :class:`Channel` holds what the ranks of one group keep alike about the collectives they called
over it: the number of the last call (``seq``), the point of the program (``key``) and the plans made
there (:mod:`._plan`), and a verdict still on its way from the device (``pending``). Each group has
its own sequence: calls over two groups interleave freely, and a disagreement inside a group is found,
and reported in a table, by that group's ranks.

The channels live in ``_state.group.channels`` (a :class:`Channels`, made at the first collective)
and go with the group: a reset forgets them, and so does a group formed anew (``_state.reform_group``).
Every channel of a process shares one :class:`~._wire.Wire`, chosen once from the state's Backend.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .. import _state
from .._state import ProcessState
from ._device import DeviceWire
from ._host import HostWire, LoopbackWire
from ._plan import Point
from ._signature import Call
from ._wire import Wire

__all__ = ["Channel", "Channels", "Pending", "channel", "check_alone", "choose_wire", "describe", "process_group"]


class Pending(NamedTuple):
    """A verdict on its way from the device: ``read`` waits for it; ``call`` is the call it judges (for the
    table). A broadcast's receiver also keeps ``seen``, the source's header (still on the device), and ``src``."""

    read: Callable[[], bool]
    call: Call
    seen: torch.Tensor | None
    src: int


class Channel:
    """One process group's checked collectives. ``ranks``: its processes' global ranks, in the group's order;
    ``me``: this process's global rank; ``world``: the group of every process (its calls are published for
    the heartbeat)."""

    __slots__ = ("device", "group", "key", "me", "pending", "plans", "ranks", "seq", "size", "wire", "world")

    def __init__(self, group: Any, ranks: tuple[int, ...], me: int, wire: Wire, device: torch.device) -> None:
        self.group, self.ranks, self.size, self.me = group, ranks, len(ranks), me
        self.wire, self.device, self.world = wire, device, group is None
        self.seq = 0  # calls begun over this group: the number of the current or last one
        self.key = 0  # the point of the program: the fingerprint of the last call every rank agreed on (0: none)
        self.plans: dict[int, Point] = {}  # what every rank sends at a point
        self.pending: Pending | None = None

    def forget(self) -> None:
        """After a disagreement, on every rank that raises: no point (the ranks' histories may differ from here),
        and no plan (their counts may differ: with a verdict read later, a rank counted a call before it knew
        that the others made another)."""
        self.key = 0
        self.plans.clear()


class Channels:
    """Every channel of this process's group: the world's, each sub-group's (by its ProcessGroup, weakly: a
    group the user drops goes with its channel), and those whose verdict is on its way, in call order."""

    __slots__ = ("again", "groups", "named", "unsettled", "wire", "world")

    def __init__(self, st: ProcessState) -> None:
        self.wire = choose_wire(st)
        self.world = Channel(None, tuple(range(st.world_size)), st.rank, self.wire, st.device)
        self.groups: weakref.WeakKeyDictionary[Any, Channel] = weakref.WeakKeyDictionary()
        self.unsettled: list[Channel] = []
        # The state whose options let a bare call run again as planned (checked, not in debug mode), and the
        # channels of the mesh dimensions' names under it; None: not known yet, or not allowed.
        self.again: ProcessState | None = None
        self.named: dict[str, Channel] = {}

    def repeating(self, st: ProcessState, group: Any) -> Channel | None:
        """The channel of ``group`` where a call may run again as its point planned it under ``st``; else None."""
        if self.again is not st:
            self.named.clear()
            self.again = st if st.options.check_collectives and not st.options.debug else None
            if self.again is None:
                return None
        if group is None:
            return self.world
        if isinstance(group, str):
            found = self.named.get(group)
            if found is None:
                found = self.named[group] = channel(st, group)
            return found
        return self.groups.get(group) if isinstance(group, dist.ProcessGroup) else None


def choose_wire(st: ProcessState) -> Wire:
    """The wire the state's Backend asks for (the host's, for a state built without one)."""
    hardware = st.hardware
    kind = hardware.wire(st.backend) if hardware is not None else "host"
    if kind == "device" and hardware is not None:
        return DeviceWire(st.device, hardware.read_later, hardware.to_device)
    return LoopbackWire(st.device) if kind == "loopback" else HostWire(st.device)


def channel(st: ProcessState, group: Any = None) -> Channel:
    """The channel of ``group``: None (every process), a torch ``ProcessGroup``, or a mesh dimension's name."""
    found: Channels | None = _state.group.channels
    if found is None:
        found = _state.group.channels = Channels(st)
    if group is None:
        return found.world
    return _of(st, found, group)


def _of(st: ProcessState, found: Channels, group: Any) -> Channel:
    if isinstance(group, str):
        group = process_group(st, group)
    if group is None or group is dist.group.WORLD:
        return found.world
    if not isinstance(group, dist.ProcessGroup):
        if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"accelkit: process {st.rank} is not in the process group passed as group= (torch's new_group "
                f"gives the processes outside a group this marker, {group}); call the collective on that group's "
                f"processes only"
            )
        raise _not_a_group(group)
    sub = found.groups.get(group)
    if sub is None:
        ranks = tuple(dist.get_process_group_ranks(group))
        if st.rank not in ranks:
            raise ValueError(
                f"accelkit: process {st.rank} is not in the process group passed as group= (its processes: "
                f"{describe(ranks)}); call the collective on that group's processes only"
            )
        sub = found.groups[group] = Channel(group, ranks, st.rank, found.wire, st.device)
    return sub


def check_alone(st: ProcessState, group: Any) -> None:
    """With one process nothing moves, but ``group`` is checked all the same: a mesh dimension's name, a type."""
    if isinstance(group, str):
        process_group(st, group)
    elif group is not None and not isinstance(group, dist.ProcessGroup):
        raise _not_a_group(group)


def _not_a_group(group: Any) -> TypeError:
    return TypeError(
        f"accelkit: group={group!r}: expected None (every process), a torch.distributed ProcessGroup, or the "
        f"name of a device mesh dimension ('dp', 'dp_replicate', 'dp_shard', 'tp', 'cp')"
    )


def process_group(st: ProcessState, name: str) -> Any:
    """The process group a mesh dimension's ``name`` stands for (None: every process), from the strategy."""
    strategy = st.strategy
    if strategy is None:  # a state built by hand: no mesh
        if name == "dp":
            return None
        raise ValueError(f"accelkit: group={name!r}: this process has no strategy, so no device mesh")
    return strategy.process_group(name)


def describe(ranks: tuple[int, ...]) -> str:
    """A group's processes, as the messages name them: ``0, 2, 4``."""
    return ", ".join(map(str, ranks))
