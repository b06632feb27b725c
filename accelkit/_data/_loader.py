"""The prepared DataLoader: epochs, generators, device moves and the active-loader entries.

While a prepared loader is iterated, an :class:`ActiveLoader` entry for it sits in
``_state.training.active_loaders`` (innermost last): ``ak.accumulate`` reads its
``at_last_batch``, ``ak.gather_for_metrics`` its ``padding``. The entry leaves when the
iteration ends, raises, or is closed (a ``break`` drops the iterator).

Device moves: on the CPU there are none. Elsewhere the hardware backend's transfer moves each
batch, and the loader reads one batch ahead: batch ``i + 1`` is loaded and its copy issued
before batch ``i`` is handed out, so that on CUDA the copy overlaps batch ``i``'s step. Which
batches come, in which order, and the bookkeeping (last batch, padding, position for
``state_dict``) count the batches handed out, not the one read ahead. The read-ahead batch is
loaded one step early: a map-style dataset that draws from the global RNG in the main process
(``num_workers=0``) draws for it before the step, not after.
"""

import base64
import weakref
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from .. import _collectives, _state
from .._backends import BatchTransfer
from ._sampling import EpochRecord, ShardedBatchSampler, ShardedIterable

__all__ = ["ActiveLoader", "LoaderPlan", "PreparedDataLoader"]

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


class LoaderPlan(NamedTuple):
    """How a prepared loader shards, orders and moves its batches (fixed at prepare time)."""

    shard: ShardedBatchSampler | ShardedIterable[Any]
    order_generator: torch.Generator | None  # draws the epoch's order: the same on every rank
    epoch_target: Any  # the user's sampler or dataset with set_epoch(), or None
    rank: int
    broadcast_device: torch.device | None  # where rank 0's generator state is broadcast; None: one process
    transfer: BatchTransfer | None  # moves batches to the device; None: they are there already (CPU)
    ragged: bool
    lookahead: bool  # iterable dataset in DataLoader workers: find the last batch by reading ahead
    # The order generator is the user's own, read when each epoch starts as a plain DataLoader
    # reads it (instead of a reseed per epoch); draws_seed: the plain loader also draws its
    # workers' base seed from that generator at the start of each epoch.
    follow: bool = False
    draws_seed: bool = False


class PreparedDataLoader(DataLoader[Any]):
    """A ``DataLoader`` that yields this rank's shard of each epoch, on ``ak.device()``.

    Made by ``ak.prepare(loader)``; ``len()`` is the number of batches per rank. Every new
    iteration is a new epoch. ``state_dict()`` / ``load_state_dict()`` save and restore
    ``{"epoch", "base_seed", "batches_yielded"}`` (and ``"order_state"`` when the order follows
    the user's generator), so that a resumed run continues the interrupted epoch exactly.
    Attributes and methods it does not define are those of the user's loader, ``base_dataloader``
    (a ``DataLoader`` subclass's own, attributes set on it); ``batch_size`` is the per-process one.

    Example:
        >>> import accelkit as ak, torch
        >>> loader = ak.prepare(torch.utils.data.DataLoader(range(6), batch_size=4))
        >>> [batch.tolist() for batch in loader]  # on rank 1 of 2: [[4, 5, 0, 1]]
        [[0, 1, 2, 3], [4, 5]]
    """

    def __init__(self, dataset: Any, plan: LoaderPlan, base_seed: int, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._plan = plan
        self._base_seed = base_seed
        self._epoch = 0  # the epoch the next iteration starts
        self._skip = 0  # batches the next iteration skips
        self._yielded = 0  # batches of the current epoch handed out (skipped ones included)
        self._running = False  # an epoch started and did not run to its end
        self._epoch_order: torch.Tensor | None = None  # the order generator's state when this epoch began
        self._pending_order: torch.Tensor | None = None  # a restored state, for the next epoch
        self._joinables: list[weakref.ReferenceType[Any]] = []  # see join_uneven_inputs
        self.base_dataloader: DataLoader[Any] | None = None  # the user's loader, set by prepare

    def __getattr__(self, name: str) -> Any:
        # Only for names not found on the prepared loader: the user's loader's.
        base = self.__dict__.get("base_dataloader")
        if base is None:  # still being built (or unpickled)
            raise AttributeError(f"'PreparedDataLoader' object has no attribute {name!r}")
        return getattr(base, name)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        plan, epoch, skip = self._plan, self._epoch, self._skip
        self._epoch, self._skip, self._yielded, self._running = epoch + 1, 0, skip, True
        seed = self._base_seed + epoch
        self._start_order(seed)
        # DataLoader workers' seeds come from this one: its own stream, different on every rank.
        self.generator.manual_seed((seed * 0x9E3779B97F4A7C15 + plan.rank) % 2**64)
        if plan.epoch_target is not None:
            plan.epoch_target.set_epoch(epoch)
        record = plan.shard.record = EpochRecord()
        if isinstance(plan.shard, ShardedBatchSampler):
            plan.shard.skip = skip  # skipped indices are never loaded
        batches: Iterator[Any] = super().__iter__()
        if plan.lookahead:
            batches = _mark_last(batches, record)
        if isinstance(plan.shard, ShardedIterable) and skip:
            batches = islice(batches, skip, None)  # a stream must be read to be skipped
        joinables = [j for j in (ref() for ref in self._joinables) if j is not None]
        iterated = self._iterate(batches, record, skip)
        return _joined(iterated, joinables) if joinables else iterated

    def _start_order(self, seed: int) -> None:
        """Put the order generator where this epoch's order starts."""
        gen, plan = self._plan.order_generator, self._plan
        if gen is None:
            return
        if not plan.follow:
            gen.manual_seed(seed % 2**64)
            return
        # The user's generator as it is now (a reseed after prepare counts, as for the plain loader), or
        # the state a resumed epoch began from; rank 0's on every rank, so that all cut the same order.
        state = self._pending_order if self._pending_order is not None else gen.get_state()
        self._pending_order = None
        if plan.broadcast_device is not None:
            state = _collectives.broadcast(state.to(plan.broadcast_device)).cpu()
        gen.set_state(state)
        self._epoch_order = state
        if plan.draws_seed:  # what a plain DataLoader draws first each epoch, from the same generator
            torch.empty((), dtype=torch.int64).random_(generator=gen)

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
        if self._running:
            state: dict[str, Any] = {"epoch": self._epoch - 1, "base_seed": self._base_seed}
            state["batches_yielded"], order = self._yielded, self._epoch_order
        else:
            state = {"epoch": self._epoch, "base_seed": self._base_seed, "batches_yielded": self._skip}
            gen = self._plan.order_generator
            order = self._pending_order if self._pending_order is not None else gen.get_state() if gen else None
        if self._plan.follow and order is not None:
            state["order_state"] = base64.b64encode(bytes(order.tolist())).decode()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue where ``state`` was taken: the next iteration resumes that epoch."""
        bad = [k for k in _STATE_KEYS if isinstance(state.get(k), bool) or not isinstance(state.get(k), int)]
        if bad:
            raise ValueError(
                f"PreparedDataLoader.load_state_dict: expected integers {', '.join(_STATE_KEYS)}, got {dict(state)!r}; "
                f"pass what loader.state_dict() returned"
            )
        order = state.get("order_state")
        if order is not None and not isinstance(order, str):
            raise ValueError(f"PreparedDataLoader.load_state_dict: order_state is {order!r}, expected base64 text")
        self._epoch, self._base_seed, self._skip = state["epoch"], state["base_seed"], state["batches_yielded"]
        if order is not None:
            raw = bytearray(base64.b64decode(order, validate=True))
            self._pending_order = torch.frombuffer(raw, dtype=torch.uint8).clone()
        self._running = False


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
