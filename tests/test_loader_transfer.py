"""Prepared loaders that move batches to a device read one batch ahead, and change nothing else.

On a GPU the hardware backend's transfer copies batch ``i + 1`` while batch ``i`` computes
(tests/test_gpu.py runs the CUDA one). Here the CPU backend is given a transfer that copies
each batch, so the read-ahead path runs on the CPU: what the batches contain, their order,
the last-batch bookkeeping (``ak.accumulate``'s boundary, ``gather_for_metrics``' padding) and
the position a checkpoint records must be those of the loader without it. Without a transfer
(the CPU as it is) batches are not copied at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler

import accelkit as ak
from accelkit._backends.cpu import CPUBackend
from accelkit._tree import apply_to_tensors
from accelkit.testing import WorkerPool


class Copying:
    """A transfer that copies every tensor (as a device copy would) and logs what it did when."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def start(self, batch: Any) -> Any:
        self.log.append(("start", first_value(batch)))
        return apply_to_tensors(torch.Tensor.clone, batch)

    def finish(self, handle: Any) -> Any:
        self.log.append(("finish", first_value(handle)))
        return handle


def first_value(batch: Any) -> Any:
    value = _plain(batch)
    while isinstance(value, (list, tuple, dict)):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    return value


@contextmanager
def moving_batches(log: list[tuple[str, Any]] | None = None) -> Iterator[list[tuple[str, Any]]]:
    """Prepared loaders made inside get the copying transfer (in this process)."""
    log = [] if log is None else log
    original = CPUBackend.batch_transfer
    CPUBackend.batch_transfer = lambda self, device: Copying(log)  # type: ignore[assignment,method-assign]
    try:
        yield log
    finally:
        CPUBackend.batch_transfer = original  # type: ignore[method-assign]


class Stream(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def loaders() -> dict[str, Any]:
    data = torch.arange(40).view(20, 2).float()
    by_four = BatchSampler(SequentialSampler(range(9)), batch_size=4, drop_last=False)
    return {
        "shuffled": lambda: DataLoader(torch.utils.data.TensorDataset(data), batch_size=3, shuffle=True),
        "dicts": lambda: DataLoader([{"x": data[i], "i": i} for i in range(7)], batch_size=2),
        "batch sampler": lambda: DataLoader(range(9), batch_sampler=by_four),
        "unbatched": lambda: DataLoader(range(5), batch_size=None),
        "stream": lambda: DataLoader(Stream(7), batch_size=3),
    }


def epochs(make: Any, moved: bool, n: int = 2) -> list[list[Any]]:
    ak.reset_state()
    ak.set_seed(3)
    if moved:
        with moving_batches():
            loader = ak.prepare(make())
    else:
        loader = ak.prepare(make())
    return [[_plain(batch) for batch in loader] for _ in range(n)]


def _plain(batch: Any) -> Any:
    return apply_to_tensors(torch.Tensor.tolist, batch)


@pytest.mark.parametrize("kind", list(loaders()))
def test_batches_moved_ahead_are_the_same_batches_in_the_same_order(kind: str) -> None:
    make = loaders()[kind]
    assert epochs(make, moved=True) == epochs(make, moved=False)


def test_the_next_copy_starts_after_the_current_batch_is_ready_and_before_it_is_used() -> None:
    with moving_batches() as log:
        loader = ak.prepare(DataLoader(range(3), batch_size=1))
    for batch in loader:
        log.append(("use", batch.item()))
    assert log == [
        ("start", 0), ("finish", 0), ("start", 1), ("use", 0),
        ("finish", 1), ("start", 2), ("use", 1),
        ("finish", 2), ("use", 2),
    ]  # fmt: skip


def test_accumulation_ends_on_the_last_batch_read_ahead_or_not() -> None:
    def boundaries() -> list[bool]:
        model = torch.nn.Linear(1, 1)
        seen = []
        for _ in loader:
            with ak.accumulate(model, steps=4):
                seen.append(ak.sync_gradients())
        return seen

    with moving_batches():
        loader = ak.prepare(DataLoader(range(6), batch_size=1))
    assert boundaries() == [False, False, False, True, False, True]


def test_a_checkpoint_position_counts_the_batches_handed_out_not_the_one_read_ahead() -> None:
    with moving_batches():
        loader = ak.prepare(DataLoader(range(10), batch_size=2, shuffle=True))
        resumed = ak.prepare(DataLoader(range(10), batch_size=2, shuffle=True))
    it = iter(loader)
    seen = [next(it).tolist() for _ in range(2)]
    state = loader.state_dict()
    assert state["batches_yielded"] == 2
    rest = [b.tolist() for b in it]
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest and len(seen + rest) == 5


def test_a_break_leaves_no_active_loader_and_the_next_epoch_is_whole() -> None:
    with moving_batches():
        loader = ak.prepare(DataLoader(range(6), batch_size=2))
    for _ in loader:
        break
    assert ak._state.training.active_loaders == []
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5]]


def test_without_a_transfer_cpu_batches_are_not_copied() -> None:
    items = [torch.full((2,), float(i)) for i in range(3)]
    loader = ak.prepare(DataLoader(items, batch_size=None))  # batches are the samples themselves
    assert all(batch is item for batch, item in zip(loader, items, strict=True))


def gathered(moved: bool) -> tuple[list[int], list[bool]]:
    """Every rank's gather_for_metrics of 11 samples in batches of 3 (the last padded), and the last-batch flags."""
    values: list[int] = []
    last: list[bool] = []
    with moving_batches() if moved else _nothing():
        loader = ak.prepare(DataLoader(range(11), batch_size=3))
    model = torch.nn.Linear(1, 1)
    for batch in loader:
        with ak.accumulate(model, steps=10):
            last.append(ak.sync_gradients())
        values += ak.gather_for_metrics(batch).tolist()
    return values, last


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@pytest.mark.distributed
def test_gather_for_metrics_drops_the_padding_of_batches_read_ahead(pool: WorkerPool) -> None:
    moved, plain = pool.run(gathered, True), pool.run(gathered, False)
    assert moved == plain
    values, last = moved[0]
    assert sorted(values) == list(range(11)) and last == [False, True]
