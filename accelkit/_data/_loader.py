"""The prepared DataLoader: epochs, generators, device moves and the active-loader entries.

While a prepared loader is iterated, an :class:`ActiveLoader` entry for it sits in
``_state.training.active_loaders`` (innermost last): ``ak.accumulate`` reads its
``at_last_batch``, ``ak.gather_for_metrics`` its ``padding``. The entry leaves when the
iteration ends, raises, or is closed (a ``break`` drops the iterator).

Device moves: on the CPU there are none. Elsewhere the hardware backend's transfer moves each
batch, and the loader reads one batch ahead: batch ``i + 1`` is loaded and its copy issued
before batch ``i`` is handed out, so that on CUDA the copy overlaps batch ``i``'s step. Where the
copies want pinned host memory, nothing pins on the iterating thread: a loader with workers pins
in DataLoader's pin-memory thread (``_build`` turns ``pin_memory`` on where the transfer asks), a
loader without them in the transfer's own thread. Which
batches come, in which order, and the bookkeeping (last batch, padding, position for
``state_dict``) count the batches handed out, not the one read ahead. The read-ahead batch is
loaded one step early: a map-style dataset that draws from the global RNG in the main process
(``num_workers=0``) draws for it before the step, not after.
"""

import base64
import weakref
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any, Literal, NamedTuple

import torch
from torch.utils.data import DataLoader

from .. import _collectives, _state
from .._backends import BatchTransfer
from ._sampling import EpochRecord, ShardedBatchSampler, ShardedIterable

__all__ = ["ActiveLoader", "LoaderPlan", "Order", "PreparedDataLoader"]

_STATE_KEYS = ("epoch", "base_seed", "batches_yielded")
_END: Any = object()


class ActiveLoader:
    """A prepared loader being iterated: whether it is at its last batch, and its padding.

    ``padding`` counts the samples ``even_batches`` added to the last global batch (all
    ranks together), ``global_size`` all samples of that global batch; ``ragged`` says
    that batches may differ in size between ranks (uneven last batches, batch samplers).
    """

    __slots__ = ("at_last_batch", "global_size", "padding", "ragged")

    def __init__(self, ragged: bool) -> None:
        self.at_last_batch = False
        self.padding = 0
        self.global_size = 0
        self.ragged = ragged


Order = Literal["none", "follow", "epoch_seed", "data_seed"]
"""How a prepared loader's order is drawn at each epoch's start (``_build._order`` chooses):

- ``"none"``: the sampler's own business (no generator attribute: sequential, a custom sampler);
- ``"follow"``: from ``order_generator`` as it stands (the user's, or one of ours seeded at prepare),
  rank 0's state copied into every rank's first;
- ``"epoch_seed"``: ``order_generator`` seeded with one draw from the global RNG (one process: what
  the plain ``RandomSampler`` draws);
- ``"data_seed"``: ``order_generator`` seeded with ``data_seed + epoch``.
"""


class LoaderPlan(NamedTuple):
    """How a prepared loader shards, orders and moves its batches (fixed at prepare time)."""

    shard: ShardedBatchSampler | ShardedIterable[Any]
    order_generator: torch.Generator | None  # draws the epoch's order: the same on every rank
    epoch_target: Any  # the user's sampler or dataset with set_epoch(), or None
    rank: int
    seed_source: torch.Generator | None  # the user's loader's generator (None: the global RNG)
    broadcast_device: torch.device | None  # where rank 0's generator state is broadcast; None: one process
    transfer: BatchTransfer | None  # moves batches to the device; None: they are there already (CPU)
    ragged: bool
    lookahead: bool  # iterable dataset in DataLoader workers: find the last batch by reading ahead
    order: Order = "none"
    data_seed: int | None = None


class PreparedDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that yields this rank's shard of each epoch, on ``ak.device()``.

    Made by ``ak.prepare(loader)``; ``len()`` is the number of batches per rank. Every new
    iteration is a new epoch; it draws from the global RNG (or the loader's ``generator``) what the
    plain loader draws, when it draws it (see ``_build``). ``state_dict()`` / ``load_state_dict()``
    save and restore ``{"epoch", "batches_yielded", "base_seed", "started"}`` (and ``"order_state"``,
    the order generator's state), so that a resumed run continues the interrupted epoch exactly: an
    epoch begun before the save continues from its saved seeds, drawing nothing again (the restored
    global RNG is past its draws). Attributes and methods it does not define are those of the user's
    loader, ``base_dataloader`` (a ``DataLoader`` subclass's own, attributes set on it); ``batch_size``
    is the per-process one.

    Example:
        >>> import accelkit as ak, torch
        >>> loader = ak.prepare(torch.utils.data.DataLoader(range(6), batch_size=4))
        >>> [batch.tolist() for batch in loader]  # on rank 1 of 2: [[4, 5, 0, 1]]
        [[0, 1, 2, 3], [4, 5]]
    """

    def __init__(self, dataset: Any, plan: LoaderPlan, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._plan = plan
        self._base_seed = 0  # the base seed the current (or last) epoch drew
        self._epoch = 0  # the epoch the next iteration starts
        self._skip = 0  # batches the next iteration skips
        self._yielded = 0  # batches of the current epoch handed out (skipped ones included)
        self._running = False  # an epoch started and did not run to its end
        self._epoch_order: torch.Tensor | None = None  # the order generator's state this epoch's order comes from
        self._pending_order: torch.Tensor | None = None  # a restored state of a followed generator, for the next epoch
        self._resumed: tuple[int, torch.Tensor | None] | None = None  # an epoch begun before a save: its seeds
        self._kept_workers = False  # persistent DataLoader workers were started
        self._joinables: list[weakref.ReferenceType[Any]] = []  # see join_uneven_inputs
        self.base_dataloader: DataLoader[Any] | None = None  # the user's loader, set by prepare

    def __getattr__(self, name: str) -> Any:
        # Only for names not found on the prepared loader: the user's loader's.
        base = self.__dict__.get("base_dataloader")
        if base is None:  # still being built (or unpickled)
            raise AttributeError(f"'PreparedDataLoader' object has no attribute {name!r}")
        return getattr(base, name)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        plan, epoch, skip, resumed = self._plan, self._epoch, self._skip, self._resumed
        self._epoch, self._skip, self._yielded, self._running, self._resumed = epoch + 1, 0, skip, True, None
        if resumed is None:
            self._start_epoch(epoch)
        else:  # continue an epoch begun before a checkpoint: its order and seed as they were, no new draw
            self._base_seed, self._epoch_order = resumed
            if plan.order_generator is not None and self._epoch_order is not None:
                plan.order_generator.set_state(self._epoch_order)
            self.generator.manual_seed(_workers_seed(self._base_seed, plan.rank))
        if plan.epoch_target is not None:
            plan.epoch_target.set_epoch(epoch)
        record = plan.shard.record = EpochRecord()
        if isinstance(plan.shard, ShardedBatchSampler):
            plan.shard.skip = skip  # skipped indices are never loaded
        batches: Iterator[Any] = super().__iter__()
        self._kept_workers = self.persistent_workers and self.num_workers > 0  # started once, kept
        if plan.lookahead:
            batches = _mark_last(batches, record)
        if isinstance(plan.shard, ShardedIterable) and skip:
            batches = islice(batches, skip, None)  # a stream must be read to be skipped
        joinables = [j for j in (ref() for ref in self._joinables) if j is not None]
        iterated = self._iterate(batches, record, skip)
        return _joined(iterated, joinables) if joinables else iterated

    def _start_epoch(self, epoch: int) -> None:
        """Draw what the plain loader draws as an epoch starts, in its order: the base seed of its
        workers, then the sampler's seed; and put the order generator where this epoch's order starts."""
        plan, gen = self._plan, self._plan.order_generator
        if plan.order == "follow" and gen is not None:
            # The generator as it is now (a reseed after prepare counts, as for the plain loader), or as a
            # checkpoint left it; rank 0's on every rank, so that all cut the same order.
            state = self._pending_order if self._pending_order is not None else gen.get_state()
            self._pending_order = None
            if plan.broadcast_device is not None:
                state = _collectives.broadcast(state.to(plan.broadcast_device)).cpu()
            gen.set_state(state)
        self._draw_base_seed(epoch)  # from the loader's generator: the followed one too, after the copy
        if plan.order == "epoch_seed" and gen is not None:  # the plain RandomSampler's draw at its first batch
            gen.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
        elif plan.order == "data_seed" and gen is not None and plan.data_seed is not None:
            gen.manual_seed((plan.data_seed + epoch) % 2**64)
        self._epoch_order = gen.get_state() if gen is not None else None

    def _draw_base_seed(self, epoch: int) -> None:
        """The plain loader's base seed: one int64 from the loader's generator (or the global RNG) as each
        iteration starts (only the first with persistent workers). The workers' seeds come from our own
        generator: on rank 0 the same as the plain loader's, on rank ``r`` mixed with ``r``."""
        if self._kept_workers:
            return  # the plain loader reuses its persistent workers, and draws nothing
        plan, own = self._plan, self.generator
        source = plan.seed_source if plan.seed_source is not None else torch.default_generator
        if plan.rank == 0 and plan.data_seed is None:
            own.set_state(source.get_state())  # its next draw is the one the plain loader makes now
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=source).item())
        if plan.data_seed is not None:  # the workers' seeds too are the same in every run
            seed = plan.data_seed + epoch
        if plan.rank != 0 or plan.data_seed is not None:
            own.manual_seed(_workers_seed(seed, plan.rank))
        self._base_seed = seed

    def join_with(self, joinables: list[Any]) -> None:
        """Iterate inside ``torch.distributed.algorithms.join.Join(joinables)``: a rank that runs out
        of batches first shadows the others' collectives (DDP's gradient all-reduce) until all are done."""
        self._joinables = [weakref.ref(j) for j in joinables]

    def _iterate(self, batches: Iterator[Any], record: EpochRecord, n: int) -> Iterator[Any]:
        plan = self._plan
        entry = ActiveLoader(plan.ragged)
        active = _state.training.active_loaders
        active.append(entry)
        if plan.transfer is not None:
            batches = _ahead(batches, plan.transfer)
        attributes = self.__dict__  # DataLoader.__setattr__ is a Python call: not once per batch
        try:
            for batch in batches:
                n += 1
                if n == record.num_batches:
                    entry.at_last_batch, entry.padding, entry.global_size = True, record.padding, record.global_size
                attributes["_yielded"] = n
                yield batch
            self._running = False
        finally:  # also on an exception, and on close() / garbage collection after a break
            for i in range(len(active) - 1, -1, -1):
                if active[i] is entry:
                    del active[i]
                    break

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epochs, for :meth:`load_state_dict`."""
        state: dict[str, Any]
        order: torch.Tensor | None
        if self._running:  # an epoch begun: a resume continues it from its seeds
            state = {"epoch": self._epoch - 1, "batches_yielded": self._yielded, "base_seed": self._base_seed}
            state["started"], order = True, self._epoch_order
        elif self._resumed is not None:  # restored, not iterated yet: the same again
            state = {"epoch": self._epoch, "batches_yielded": self._skip, "base_seed": self._resumed[0]}
            state["started"], order = True, self._resumed[1]
        else:  # between epochs: the next one draws afresh; a followed generator's state goes with it
            state = {"epoch": self._epoch, "batches_yielded": self._skip, "base_seed": self._base_seed}
            gen, order = self._plan.order_generator, None
            if self._plan.order == "follow" and gen is not None:
                order = self._pending_order if self._pending_order is not None else gen.get_state()
            state["started"] = False
        if order is not None:
            state["order_state"] = base64.b64encode(bytes(order.tolist())).decode()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` was taken: the next iteration resumes that epoch."""
        bad = [k for k in _STATE_KEYS if isinstance(state.get(k), bool) or not isinstance(state.get(k), int)]
        started = state.get("started", False)
        if bad or not isinstance(started, bool):
            raise ValueError(
                f"PreparedDataLoader.load_state_dict: expected integers {', '.join(_STATE_KEYS)} and a bool started, "
                f"got {dict(state)!r}; pass what loader.state_dict() returned"
            )
        text = state.get("order_state")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"PreparedDataLoader.load_state_dict: order_state is {text!r}, expected base64 text")
        order = None
        if text is not None:
            order = torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8).clone()
        self._epoch, self._skip, self._base_seed = state["epoch"], state["batches_yielded"], state["base_seed"]
        self._resumed = (self._base_seed, order) if started else None
        self._pending_order = None if started else order
        self._running = False


def _workers_seed(seed: int, rank: int) -> int:
    """Seeds the generator rank ``rank`` draws its workers' base seed from: a stream of its own each epoch."""
    return (seed * 0x9E3779B97F4A7C15 + rank) % 2**64


def _joined(batches: Iterator[Any], joinables: list[Any]) -> Iterator[Any]:
    from torch.distributed.algorithms.join import Join

    with Join(joinables):
        yield from batches


def _ahead(batches: Iterator[Any], transfer: BatchTransfer) -> Iterator[Any]:
    """``batches`` moved by ``transfer``, each copy started one batch before it is handed out."""
    following = next(batches, _END)
    pending = transfer.start(following) if following is not _END else _END
    while pending is not _END:
        ready = transfer.finish(pending)  # before the next copy starts: the step waits for this batch only
        following = next(batches, _END)
        pending = transfer.start(following) if following is not _END else _END
        yield ready


def _mark_last(batches: Iterator[Any], record: EpochRecord) -> Iterator[Any]:
    """``batches``, read one ahead so that ``record`` knows the last one before it is yielded."""
    current, n = next(batches, _END), 0
    while current is not _END:
        following = next(batches, _END)
        n += 1
        if following is _END:
            record.num_batches = n
        yield current
        current = following
