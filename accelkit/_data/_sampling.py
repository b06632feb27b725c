"""How a prepared DataLoader cuts one epoch between the ranks: index arithmetic only.

The epoch's base order (a sampler's indices, a batch sampler's batches, or an iterable
dataset's items: *units*) is cut into *rounds* of ``world * size`` units, and rank ``r``
takes the contiguous slice ``[r * size, (r + 1) * size)`` of each round. One process with a
batch ``world`` times larger sees round ``k`` at step ``k``, so training is equivalent.

The final round, when incomplete, is dropped (``drop_last``), completed from the start of
the epoch's order (``even``: the added units sit at the end of the round, in rank order,
so a rank-order gather ends with them), or left uneven (the last ranks get fewer units or
none). No randomness and no communication here: the loader owns the generators.

Example:
    >>> layout = Layout(rank=1, world=2, size=2, even=True, drop_last=False)
    >>> list(slice_rounds(iter(range(5)), layout, EpochRecord()))
    [[2, 3], [1, 2]]
"""

from collections.abc import Callable, Iterable, Iterator, Sized
from itertools import cycle, islice
from typing import Any, NamedTuple, TypeVar

from torch.utils.data import IterableDataset, Sampler

T = TypeVar("T")

__all__ = ["EpochRecord", "Layout", "ShardedBatchSampler", "ShardedIterable", "slice_rounds"]


class EpochRecord:
    """What one epoch's sharding found out about this rank's last batch.

    ``num_batches`` is None until the shard has seen the end of the base order; it is set
    before the last batch is handed out. ``padding`` counts the samples that ``even`` added
    to the final round (all ranks together), ``global_size`` all samples of that round.
    """

    __slots__ = ("global_size", "num_batches", "padding")

    def __init__(self) -> None:
        self.num_batches: int | None = None
        self.padding = 0
        self.global_size = 0


class Layout(NamedTuple):
    """Rank ``rank`` of ``world`` takes ``size`` units of each round of ``world * size``."""

    rank: int
    world: int
    size: int
    even: bool  # complete the final round (only meaningful with world > 1)
    drop_last: bool

    def slices_per_rank(self, units: int) -> int:
        """How many non-empty slices this rank gets from ``units`` units."""
        full, rest = divmod(units, self.world * self.size)
        if rest == 0 or self.drop_last:
            return full
        return full + 1 if self.even else full + (rest > self.rank * self.size)

    def units_per_rank(self, units: int) -> int:
        """How many units this rank gets from ``units`` units (padding included)."""
        full, rest = divmod(units, self.world * self.size)
        if rest == 0 or self.drop_last:
            return full * self.size
        if self.even:
            return (full + 1) * self.size
        return full * self.size + min(self.size, max(0, rest - self.rank * self.size))


def _round(chunk: list[T], head: list[T], layout: Layout) -> tuple[list[T], int] | None:
    """The next round, from its ``chunk`` of units, and how many of them are real: a short last one is
    completed from ``head`` (the epoch's first round) when ``even``; None when none is left for this rank."""
    size = layout.world * layout.size
    real = len(chunk)
    if real == size:
        return chunk, size
    if not chunk or layout.drop_last or (not layout.even and real <= layout.rank * layout.size):
        return None  # nothing left, or nothing left for this rank
    if layout.even:
        chunk = chunk + list(islice(cycle(head), size - real))
    return chunk, real


def slice_rounds(
    units: Iterator[T],
    layout: Layout,
    record: EpochRecord,
    count: Callable[[list[T]], int] = len,
    start: int = 0,
) -> Iterator[list[T]]:
    """This rank's slice of each round of ``units``, skipping the first ``start`` slices.

    The rounds are read one ahead, so that ``record`` is complete before the last slice
    is yielded. ``count`` turns units into samples for the record (``len`` for indices;
    the summed batch sizes when the units are batches). One generator: it runs once per batch.
    """
    size = layout.world * layout.size
    lo, hi = layout.rank * layout.size, (layout.rank + 1) * layout.size
    head = list(islice(units, size))
    current = _round(head, head, layout)
    n = 0
    while current is not None:
        chunk, real = current
        following = None
        if real == size:  # a complete round: another may follow
            units_next = list(islice(units, size))
            # What _round makes of a complete one, without the call: the common case, once per batch.
            following = (units_next, size) if len(units_next) == size else _round(units_next, head, layout)
        n += 1
        if following is None:
            record.padding, record.global_size = count(chunk[real:]), count(chunk)
            record.num_batches = n
        if n > start:
            yield chunk[lo:hi]
        current = following


def _samples(batches: list[Any]) -> int:
    return sum(len(b) for b in batches)


class ShardedBatchSampler(Sampler[Any]):
    """This rank's batches from ``base``, for a map-style dataset.

    With ``batch_size`` set, ``base`` yields indices (a sampler) and each batch is this
    rank's ``batch_size`` indices of a round. With ``batch_size=None``, ``base`` yields
    whole batches (a user's batch sampler) and this rank takes every ``world``-th batch.
    ``unbatched`` yields single indices (a DataLoader with ``batch_size=None``). Before
    each epoch the loader sets ``record`` and ``skip`` (batches not to yield).
    """

    def __init__(self, base: Iterable[Any], layout: Layout, *, batches: bool, unbatched: bool = False) -> None:
        self.base = base
        self.layout = layout
        self.batches = batches
        self.unbatched = unbatched
        self.record = EpochRecord()
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        count = _samples if self.batches else len
        slices = slice_rounds(iter(self.base), self.layout, self.record, count, self.skip)
        return (s[0] for s in slices) if self.batches or self.unbatched else slices

    def __len__(self) -> int:
        return self.layout.slices_per_rank(len(self.base))  # type: ignore[arg-type]


class ShardedIterable(IterableDataset[T]):
    """This rank's items of an iterable ``dataset``: its slice of each round, in order.

    With ``num_workers=0`` the loader reads ``record`` (set before each epoch) in this
    process; DataLoader workers fill their own copies, which the loader cannot see.
    """

    def __init__(self, dataset: Iterable[T], layout: Layout) -> None:
        self.dataset = dataset
        self.layout = layout
        self.record = EpochRecord()

    def __iter__(self) -> Iterator[T]:
        return _items(slice_rounds(iter(self.dataset), self.layout, self.record))

    def __len__(self) -> int:
        if not isinstance(self.dataset, Sized):
            raise TypeError(f"{type(self.dataset).__name__} has no len(), so neither has its prepared DataLoader")
        return self.layout.units_per_rank(len(self.dataset))


def _items(slices: Iterator[list[T]]) -> Iterator[T]:
    for part in slices:
        yield from part
