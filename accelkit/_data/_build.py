"""Prepared DataLoaders: this rank's shard of every epoch, on the device; gather_for_metrics.

``ak.prepare(loader)`` calls :func:`prepare_dataloader`. Two processes with batch ``B``
see at step ``k`` exactly the samples one process with batch ``2 * B`` sees in the same order
(``_sampling`` cuts the epochs), in a new order every epoch that is the same on every rank and
the same for the same ``ak.set_seed``. The order and the global RNG's draws are those of
Accelerate's prepared loader (with one process: of the plain loader), so a shuffle without a
``generator`` differs with the number of processes, as there (``_loader`` owns the generators
and the bookkeeping that :func:`gather_for_metrics` and ``ak.accumulate`` read).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any, Literal, TypeVar, overload

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from .. import _collectives, _state, _tree
from .._options import is_int
from .._state import ProcessState
from ._loader import ActiveLoader, LoaderPlan, Order, PreparedDataLoader
from ._parallel import DataParallel, data_parallel
from ._sampling import Layout, ShardedBatchSampler, ShardedIterable

T = TypeVar("T")

__all__ = ["PreparedDataLoader", "gather_for_metrics", "prepare_dataloader", "skip_first_batches"]

_MISSING: Any = object()


def prepare_dataloader(
    loader: DataLoader[Any], *, even_batches: bool = True, split_batches: bool = False, data_seed: int | None = None
) -> DataLoader[Any]:
    """``loader`` rebuilt to yield this rank's shard of each epoch, on ``ak.device()``.

    Every rank must call it, in the same order. Each rank keeps the per-process batch size;
    rank ``r`` takes slice ``r`` of each global batch (``batch_size * world_size`` samples of the
    sampler's order). The final global batch, if incomplete: dropped with ``drop_last``; with
    ``even_batches`` (and several processes) completed by wrapping around to the start of the
    epoch, so that every rank gets the same number of full batches (:func:`gather_for_metrics`
    removes the added samples); without, left uneven: the last ranks get a smaller batch or none,
    so they may run one step fewer and every collective in the loop must then be guarded so that
    all ranks call it equally.

    ``split_batches=True`` (Accelerate's option of that name): the loader's ``batch_size`` is the
    global batch, split between the ranks (it must divide by the number of processes), so the
    steps per epoch are those of one process.

    The order: the sampler's (``shuffle=True``'s ``RandomSampler``, a ``WeightedRandomSampler``,
    a custom sampler). When the loader (or its sampler) has a ``generator``, the order is drawn from
    that generator, read when each epoch's iteration starts and advanced as the plain loader would
    (one process sees the same batches as the unprepared loader, and ``g.manual_seed(...)`` after
    prepare counts). Rank 0's state is broadcast into every rank's generator at that start, so
    every rank must start each epoch. A sampler without one draws its order as Accelerate's prepared
    loader does: from a generator seeded with one draw from the global RNG here (several processes;
    rank 0's at each epoch's start), or at each epoch's start as the plain ``RandomSampler`` does (one
    process); ``data_seed``: reseeded with ``data_seed + epoch`` (the same order in every run, whatever
    the other seeds). Each iteration also draws the plain loader's base seed (for its workers) from the
    loader's ``generator``, or the global RNG; rank ``r > 0`` seeds its workers from it and ``r``.
    ``set_epoch(epoch)`` is called on samplers and datasets that have one. A custom sampler without
    a ``generator`` attribute must yield the same order on every rank. A custom ``batch_sampler`` (or
    a ``BatchSampler`` passed as ``sampler`` with ``batch_size=None``) is sharded by whole batches
    (rank ``r`` takes batches ``r, r + world, ...``; even_batches repeats the first batches, counted
    in samples). Iterable datasets: every rank reads the stream and keeps its slice of each global
    batch; with DataLoader workers each worker's stream is sharded (and padded) on its own.

    Example:
        >>> import accelkit as ak, torch
        >>> from accelkit._data import prepare_dataloader
        >>> loader = prepare_dataloader(torch.utils.data.DataLoader(range(10), batch_size=4))
        >>> len(loader)  # 2 on each of 2 processes
        3
    """
    if isinstance(loader, PreparedDataLoader):
        return loader
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"accelkit.prepare_dataloader: expected a torch.utils.data.DataLoader, got {type(loader).__qualname__} "
            f"{loader!r:.60}; wrap the data first: ak.prepare(torch.utils.data.DataLoader(dataset, batch_size=32))"
        )
    for name, flag in (("even_batches", even_batches), ("split_batches", split_batches)):
        if not isinstance(flag, bool):
            raise TypeError(f"accelkit.prepare({name}={flag!r}): expected True or False")
    if data_seed is not None and (not is_int(data_seed) or not 0 <= data_seed < 2**63):
        raise ValueError(
            f"accelkit.prepare(data_seed={data_seed!r}): expected a non-negative integer, e.g. data_seed=42"
        )
    st = _state.get()
    if isinstance(loader.dataset, IterableDataset):
        prepared = _prepare_stream(loader, st, even_batches, split_batches, data_seed)
    else:
        prepared = _prepare_map(loader, st, even_batches, split_batches, data_seed)
    prepared.base_dataloader = loader
    _state.training.loaders.append(weakref.ref(prepared))  # ak.save_state records its position
    return prepared


def _prepare_map(
    loader: DataLoader[Any], st: ProcessState, even_batches: bool, split_batches: bool, data_seed: int | None
) -> PreparedDataLoader:
    base, size, drop, batches = _base_order(loader)
    dp = data_parallel(st)
    if split_batches and batches:
        raise ValueError(
            "accelkit.prepare(split_batches=True): this DataLoader has a batch sampler, whose batches are "
            "sharded whole between the processes; drop split_batches, or give the DataLoader a batch_size"
        )
    size = _split(size, dp, split_batches)
    order, order_gen, base = _order(base, batches, st, data_seed)
    layout = Layout(dp.rank, dp.size, size, even=even_batches and dp.size > 1, drop_last=drop)
    unbatched = loader.batch_sampler is None
    shard = ShardedBatchSampler(base, layout, batches=batches, unbatched=unbatched)
    ragged = batches or not (layout.even or drop)
    plan = _plan(st, dp, loader, shard, order_gen, base, ragged=ragged, lookahead=False)
    plan = plan._replace(order=order, data_seed=data_seed)
    options = _loader_options(loader, plan)
    if unbatched:
        return PreparedDataLoader(loader.dataset, plan, sampler=shard, batch_size=None, **options)
    prepared = PreparedDataLoader(loader.dataset, plan, batch_sampler=shard, **options)
    if not batches:  # a batch_sampler makes DataLoader forget these; keep them for the user
        object.__setattr__(prepared, "batch_size", size)
        object.__setattr__(prepared, "drop_last", drop)
    return prepared


def _prepare_stream(
    loader: DataLoader[Any], st: ProcessState, even_batches: bool, split_batches: bool, data_seed: int | None
) -> PreparedDataLoader:
    dp = data_parallel(st)
    even = even_batches and dp.size > 1
    size = _split(loader.batch_size or 1, dp, split_batches)
    layout = Layout(dp.rank, dp.size, size, even=even, drop_last=loader.drop_last)
    shard: ShardedIterable[Any] = ShardedIterable(loader.dataset, layout)  # type: ignore[arg-type]
    in_workers = loader.num_workers > 0
    if in_workers and even:
        warnings.warn(
            "accelkit.prepare: an iterable dataset read by DataLoader workers is sharded and padded per worker, "
            "so gather_for_metrics cannot drop the padding; use num_workers=0 or even_batches=False for exact metrics",
            stacklevel=5,  # the caller of ak.prepare
        )
    ragged = not (even or loader.drop_last)
    plan = _plan(st, dp, loader, shard, None, loader.dataset, ragged=ragged, lookahead=in_workers)
    plan = plan._replace(data_seed=data_seed)
    options = _loader_options(loader, plan)
    return PreparedDataLoader(shard, plan, batch_size=size, drop_last=loader.drop_last, **options)


def skip_first_batches(loader: DataLoader[Any], num_batches: int) -> DataLoader[Any]:
    """``loader``, whose next iteration starts ``num_batches`` batches into its epoch.

    For resuming in the middle of an epoch: the skipped samples of a map-style dataset
    are not loaded. Later iterations are whole epochs again; ``len(loader)`` is unchanged.
    The prepared loader itself is returned (and changed).

    Args:
        loader: a prepared dataloader.
        num_batches: how many batches of its epoch to skip.

    Example:
        >>> import accelkit as ak, torch
        >>> loader = ak.prepare(torch.utils.data.DataLoader(range(6), batch_size=2))
        >>> [b.tolist() for b in ak.skip_first_batches(loader, 2)]
        [[4, 5]]
    """
    if not is_int(num_batches):
        raise TypeError(f"accelkit.skip_first_batches(num_batches={num_batches!r}): expected an integer, e.g. 3")
    if num_batches < 0:
        raise ValueError(
            f"accelkit.skip_first_batches(num_batches={num_batches}): expected 0 or more batches to skip, "
            f"e.g. the number of batches this epoch had already seen (step % len(loader))"
        )
    if not isinstance(loader, PreparedDataLoader):
        raise TypeError(
            f"accelkit.skip_first_batches: expected a DataLoader returned by ak.prepare, got "
            f"{type(loader).__qualname__}; prepare it first: loader = ak.prepare(loader)"
        )
    loader._skip = num_batches
    return loader


@overload
def gather_for_metrics(data: T, use_gather_object: Literal[False] = False) -> T: ...
@overload
def gather_for_metrics(data: Any, use_gather_object: Literal[True]) -> list[Any]: ...
def gather_for_metrics(data: Any, use_gather_object: bool = False) -> Any:
    """``ak.gather(data)``, minus the samples ``even_batches`` added to the last batch.

    Every rank must call it. The padding removed is that of the innermost prepared
    loader being iterated, when it is at its last batch: each gathered tensor (or, with
    ``use_gather_object=True``, the flattened list of every rank's list items) whose
    length is that global batch's size loses its last ``padding`` entries, so the totals
    over an epoch equal the dataset length. Uneven last batches are gathered whole.
    With one process ``data`` itself is returned.

    Args:
        data: a tensor or a tree of them, as :func:`gather` takes it; any picklable objects with
            ``use_gather_object``.
        use_gather_object: gather with :func:`gather_object` (lists of strings, ragged tensors) and
            flatten the ranks' lists into one.

    Example:
        >>> import accelkit as ak, torch
        >>> ak.gather_for_metrics(torch.tensor([1, 2]))  # the padding dropped
        tensor([1, 2])
    """
    st = _state.get()
    if not st.distributed:
        return data
    active = _state.training.active_loaders
    entry: ActiveLoader | None = active[-1] if active else None
    cut = entry.padding if entry is not None and entry.at_last_batch else 0
    size = entry.global_size if entry is not None else 0
    if use_gather_object:
        parts = _collectives.gather_object(data, group="dp")
        items = [x for part in parts for x in (part if isinstance(part, (list, tuple)) else (part,))]
        return items[: size - cut] if cut and len(items) == size else items
    if isinstance(data, torch.Tensor) and (entry is None or not entry.ragged):  # one tensor: no tree to build
        everyone = _collectives.gather(data, group="dp")
        return everyone[: size - cut] if cut and everyone.shape[0] == size else everyone
    try:
        leaves, spec = _tree.flatten(data, "accelkit.gather_for_metrics")
    except TypeError as exc:
        raise TypeError(f"{exc} Or pass use_gather_object=True for non-tensor data.") from None
    if not leaves:
        return data
    ragged = entry is not None and entry.ragged
    out = _gather_ragged(leaves) if ragged else _collectives.gather(leaves, group="dp")
    if cut:
        out = [x[: size - cut] if x.shape[0] == size else x for x in out]
    return _tree.unflatten(spec, out)


def _gather_ragged(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gather tensors whose first dimension differs between the data-parallel ranks: sizes first, then data."""
    leaves = [x.reshape(1) if x.dim() == 0 else x for x in leaves]
    sizes = _collectives.gather(torch.tensor([x.shape[0] for x in leaves], device=leaves[0].device), group="dp")
    table = sizes.view(-1, len(leaves)).tolist()
    world = len(table)
    longest = [max(column) for column in zip(*table, strict=True)]
    padded = [
        torch.cat([x, x.new_zeros((m - x.shape[0], *x.shape[1:]))]) if x.shape[0] < m else x
        for x, m in zip(leaves, longest, strict=True)
    ]
    gathered = _collectives.gather(padded, group="dp")
    return [
        torch.cat([g[r * m : r * m + table[r][i]] for r in range(world)])
        for i, (g, m) in enumerate(zip(gathered, longest, strict=True))
    ]


def _base_order(loader: DataLoader[Any]) -> tuple[Any, int, bool, bool]:
    """What orders a map-style loader: (sampler or batch sampler, units per batch, drop_last, whole batches)."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the sampler's items are fetched one at a time
        # ... unless the sampler yields whole batches (DataLoader(ds, sampler=BatchSampler(...), batch_size=None)).
        return loader.sampler, 1, False, isinstance(loader.sampler, BatchSampler)
    if type(batch_sampler) is BatchSampler:
        return batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last, False
    return batch_sampler, 1, False, True


def _sampler_generator(base: Any, batches: bool) -> Any:
    """The generator the sampler draws its order from (None: a seed from the global RNG); _MISSING: it has none."""
    sampler: Any = getattr(base, "sampler", None) if batches else base
    if isinstance(sampler, DistributedSampler):
        raise ValueError(
            "accelkit.prepare: the DataLoader's sampler is a DistributedSampler, which would shard the data a "
            "second time; build the DataLoader with shuffle=True (or a plain sampler) and let ak.prepare shard it"
        )
    used = getattr(sampler, "generator", _MISSING)
    return used if used is None or isinstance(used, torch.Generator) else _MISSING


def _with_generator(base: Any, batches: bool, generator: torch.Generator) -> Any:
    """``base``, copied to draw from ``generator`` (its sampler has a ``generator`` attribute)."""
    sampler: Any = copy.copy(base.sampler if batches else base)
    sampler.generator = generator
    if not batches:
        return sampler
    base = copy.copy(base)
    base.sampler = sampler
    return base


def _split(size: int, dp: DataParallel, split_batches: bool) -> int:
    """The per-process batch size: ``size`` itself, or with ``split_batches`` its share of it."""
    if not split_batches:
        return size
    if size % dp.size:
        who = "processes" if dp.group is None else "data-parallel processes"  # on a mesh: the ranks that load apart
        raise ValueError(
            f"accelkit.prepare(split_batches=True): batch_size={size} does not split evenly between "
            f"{dp.size} {who}; use a multiple of {dp.size}, or split_batches=False"
        )
    return size // dp.size


def _order(
    base: Any, batches: bool, st: ProcessState, data_seed: int | None
) -> tuple[Order, torch.Generator | None, Any]:
    """How the epochs' order is drawn, from which generator, and the sampler (copied) that draws it.

    As Accelerate orders them, and with one process as the plain loader does: a sampler's own generator
    is followed; a sampler without one (``shuffle=True`` without a ``generator``) draws its order from a
    generator of ours, seeded with one draw from the global RNG at each epoch's start (the plain loader's
    ``RandomSampler``; one process) or once, here (Accelerate's prepared loader; several processes).
    """
    used = _sampler_generator(base, batches)
    if used is _MISSING:  # a sampler without a generator attribute: its order is its own
        return "none", None, base
    if isinstance(used, torch.Generator) and data_seed is None:  # read live at each epoch's start
        return "follow", used, base
    owned = torch.Generator()
    base = _with_generator(base, batches, owned)
    if data_seed is not None:
        return "data_seed", owned, base
    if st.world_size == 1:  # with several (a tensor-parallel group's too), rank 0's seed orders every rank
        return "epoch_seed", owned, base
    owned.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))  # rank 0's wins at each epoch
    return "follow", owned, base


def _plan(
    st: ProcessState,
    dp: DataParallel,
    loader: DataLoader[Any],
    shard: ShardedBatchSampler | ShardedIterable[Any],
    order_generator: torch.Generator | None,
    epoch_target: Any,
    *,
    ragged: bool,
    lookahead: bool,
) -> LoaderPlan:
    return LoaderPlan(
        shard=shard,
        order_generator=order_generator,
        epoch_target=epoch_target if callable(getattr(epoch_target, "set_epoch", None)) else None,
        rank=dp.rank,  # the ranks of a tensor-parallel group load alike (their workers' random transforms too)
        seed_source=loader.generator,
        broadcast_device=st.device if st.distributed else None,
        transfer=st.hardware.batch_transfer(st.device) if st.hardware is not None else None,
        ragged=dp.size > 1 and ragged,
        lookahead=lookahead,
    )


def _loader_options(loader: DataLoader[Any], plan: LoaderPlan) -> dict[str, Any]:
    from .._launcher import LoaderWorkerLifeline  # once a loader is prepared

    # Pinned batches, where the device's copies want them and the loader pins beside the step (the
    # backend's transfer says); a user's pin_memory=True as it is, never pinned a second time.
    pin = loader.pin_memory or (plan.transfer is not None and plan.transfer.pin_in_loader(loader.num_workers))
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": pin,
        "timeout": loader.timeout,
        # Workers die with this rank (Linux), whatever ends it; the user's init function runs after.
        "worker_init_fn": LoaderWorkerLifeline(loader.worker_init_fn) if loader.num_workers else loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": torch.Generator(),  # owned: the workers' seeds, drawn as the plain loader draws them (see _loader)
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if hasattr(loader, "in_order"):  # torch >= 2.6
        options["in_order"] = loader.in_order
    return options
