"""What the process-global object holds: the state snapshot, and the records of training and of the group."""

import dataclasses
import weakref
from collections.abc import Mapping
from dataclasses import field as _field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._backends import Backend
from .._options import Options

if TYPE_CHECKING:
    from .._strategies import Strategy

__all__ = ["NOWHERE", "GroupState", "Now", "ProcessState", "TrainingState"]


@dataclasses.dataclass(frozen=True)
class ProcessState:
    """Where this process stands in the job. Read it with ``ak.state()``.

    An immutable record: ``dataclasses.replace(st, name=value)`` makes a changed copy. ``pid``,
    ``hardware``, ``strategy``, ``sources`` and ``origins`` take no part in its equality, hash and repr.

    Attributes:
        rank: the global rank (``ak.rank()``).
        world_size: the number of processes in the job.
        local_rank: the rank on this node.
        local_world_size: the number of processes on this node.
        node_rank: this node's rank.
        num_nodes: the number of nodes.
        device: the device this process computes on.
        backend: the process group's backend (``"gloo"``, ``"nccl"``, ...).
        options: the resolved options (``options.precision``, ``options.gradient_accumulation_steps``).
        launcher: what started this process: ``"torchrun"``, ``"env"``, ``"openmpi"``, ``"pmi"``,
            ``"slurm"`` or ``"none"``.
        restart_count: how many times the elastic agent restarted the job so far.
        pid: the process that made the state (a forked child does not use its parent's).
        hardware: the device backend in use.
        strategy: the training strategy in use (``ak.strategy()`` names it).
        sources: for each option, the layer it came from (code, ``ACCELKIT_*``, config file, default).
        origins: for each option set in code, the call that set it.

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
    # Not compared:
    pid: int = _field(
        default=0, compare=False, repr=False
    )  # the process that made it: a forked child does not use its parent's
    hardware: "Backend | None" = _field(default=None, compare=False, repr=False)
    strategy: "Strategy | None" = _field(default=None, compare=False, repr=False)  # chosen once, from the options
    sources: Mapping[str, str] = _field(default_factory=dict, compare=False, repr=False)  # option -> its layer
    origins: Mapping[str, str] = _field(default_factory=dict, compare=False, repr=False)  # option -> who set it in code

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0


class TrainingState:
    """The mutable side of training in this process; reset in place with the process state (one
    object for the life of the process: ``_state.training``, read on the step path).

    - ``micro_step``: micro-steps seen inside ``ak.accumulate`` since the last reset.
    - ``sync_gradients``: whether the current step synchronises gradients and really
      steps the optimizer (False on accumulation micro-steps).
    - ``active_loaders``: prepared dataloaders being iterated, innermost last; each entry
      knows whether it is on its last batch and how many samples it padded there.
    - ``accumulation_steps``: the steps of the innermost ``ak.accumulate`` (1 outside);
      ``accumulating``: how many ``ak.accumulate`` regions are open (0 outside).
    - ``backward_calls``: ``ak.backward`` calls so far (a region compares it at entry and exit).
    - ``unsynced``: how many ``ak.no_sync`` regions are open (the heartbeat: a backward there waits for no one).
    - ``whole_regions``: ``ak.accumulate`` regions with ``steps`` left at 1 that ran ``ak.backward``
      since a prepared optimizer last stepped (more than one: micro-steps in a loop without ``steps=``).
    - ``warned``: the training warnings given once (again after a reset: a new run).
    - ``strategy``: the current state's strategy, kept here for the step path (an attribute read,
      where ``strategy()`` is a call); None until a state exists. Set with the state (:meth:`use`),
      and reset with every new state (``reset_state``, a new task, a fork).
    - ``torch_step``: the step path is torch's own (the strategy's ``torch_step``, and no fp16 grad
      scaler): ``ak.backward`` and the prepared optimizer then call torch after one flag read.
    - ``optimizers``: the prepared optimizers. Weak: an optimizer the user dropped no longer takes part.
    - ``loaders``: every prepared dataloader, in the order prepared (weak references, so
      a dropped loader is forgotten); ``ak.save_state`` saves their positions and
      ``ak.load_state`` restores them by that order. A list, not a ``WeakSet``: the order
      is how a resumed run matches each saved position to its loader.
    - ``models``: the models ``ak.prepare`` returned (weak), so that preparing one again is a no-op.
    - ``schedulers``: the prepared schedulers (weak), whose lengths ``ak.end_training`` checks.
    - ``saving``: ``ak.save_state(blocking=False)``'s save in flight and staging buffers
      (``checkpoint/_async``); ``close()`` waits for it, before the state or group goes.
    """

    __slots__ = ("accumulating", "accumulation_steps", "active_loaders", "backward_calls", "loaders", "micro_step",
                 "models", "optimizers", "saving", "schedulers", "strategy", "sync_gradients", "torch_step",
                 "unsynced", "warned", "whole_regions")  # fmt: skip

    def __init__(self) -> None:
        self.micro_step = 0
        self.sync_gradients = True
        self.active_loaders: list[Any] = []
        self.accumulation_steps = 1
        self.accumulating = 0
        self.backward_calls = 0
        self.unsynced = 0
        self.whole_regions = 0
        self.warned: set[str] = set()
        self.strategy: Strategy | None = None
        self.torch_step = False
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.loaders: list[weakref.ReferenceType[Any]] = []
        self.models: weakref.WeakSet[Any] = weakref.WeakSet()
        self.schedulers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.saving: Any = None

    def use(self, strategy: "Strategy | None") -> None:
        """Hold ``strategy`` for the step path; call it again when its grad scaler changes (``ak.prepare``)."""
        self.strategy = strategy
        self.torch_step = strategy is not None and strategy.torch_step and strategy.scaler is None


class Now(NamedTuple):
    """Where this rank is, as the heartbeat reads it: an immutable snapshot, replaced whole.

    ``op`` / ``seq``: the current or last collective; ``inside``: waiting in it now; ``since``:
    ``time.monotonic()`` when it entered (inside) or left it; ``thread``: the thread that called it;
    ``fingerprint`` and ``text``: the call, while inside (what two ranks in the same call share, and
    the call as the tables show it); ``doing``: a step that waits for the other ranks outside the
    collectives (an FSDP forward, through its hooks), or "" (the heartbeat finds DDP's passes itself).
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


class GroupState:
    """What belongs to the process group accelkit formed, and goes with it (reset in place: one
    object for the life of the process, ``_state.group``, read by the collectives).

    - ``prefix``: the group's key prefix in the job's store. Each attempt of an elastic job and
      each group this process forms (again after ``reset_state``) gets its own, so a new group
      never reads the keys of the one before.
    - ``agreements``: ``find_executable_batch_size``'s agreements so far (their store keys),
      and ``previous_agreement`` the key prefix of the last one, deleted after the next.
    """

    __slots__ = ("agreements", "board", "channels", "checkpoint_group", "closed", "heartbeat", "job_store", "meetings",
                 "now", "prefix", "previous_agreement", "store")  # fmt: skip

    def __init__(self) -> None:
        self.prefix = "accelkit"
        self.agreements = 0
        self.previous_agreement = ""
        # The collectives' channels, one per process group they ran over (_collectives' own record, made at the
        # first collective): forgotten with the group, and when it is formed anew (reform_group).
        self.channels: Any = None
        self.checkpoint_group: Any = (
            None  # the gloo group background saves agree over (checkpoint/_async), made on first use
        )
        self.meetings: dict[str, int] = {}  # _group.meet's count of each step's meetings
        self.closed = ""  # why this rank closed the group (ranks out of step after a broadcast), or ""
        # Where this rank is: replaced whole by the collectives, read by the heartbeat thread.
        self.now = NOWHERE
        self.store: Any = None  # a client of the job's store with a short timeout: the heartbeat's, and reports
        self.job_store: Any = None  # the job's store the group was formed on (its waits are long: agreements)
        self.board = ""  # the key prefix of positions and reports in that store (see _group)
        self.heartbeat: Any = None  # the heartbeat thread (see _group)
